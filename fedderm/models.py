"""Model factory: ``create_model(name, num_classes, image_size)`` (timm-style registry).

Every model exposes ``forward_features(x) -> (B, D)`` and ``head`` (the output layer), so that
self-supervised methods can swap heads and fine-tuning can attach a new linear head.
Nothing is downloaded: models start from random weights or a local checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    def deco(fn):
        _MODELS[name] = fn
        return fn

    return deco


def list_models() -> list[str]:
    return sorted(_MODELS)


def create_model(name: str, num_classes: int, image_size: int = 64, **kwargs) -> nn.Module:
    """Build model ``name`` with a ``num_classes``-way head, randomly initialised (``vit_pool``:
    see :data:`VIT_POOLS`; other models ignore it)."""
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(list_models())}")
    return _MODELS[name](num_classes=num_classes, image_size=image_size, **kwargs)


def create_classifier(cfg, num_classes: int) -> nn.Module:
    """The run's classifier: ``cfg.model`` at ``cfg.image_size``, a ViT pooled as ``cfg.vit_pool``."""
    return create_model(cfg.model, num_classes, cfg.image_size, vit_pool=cfg.vit_pool)


class ResNetClassifier(nn.Module):
    """A torchvision ResNet trunk with ``forward_features`` and a linear ``head``.

    ``small_stem`` replaces the 7×7/2 convolution and max-pool by a 3×3/1 convolution, the usual
    change for images under 48 px (chosen automatically by the factory).
    """

    def __init__(self, arch: str, num_classes: int, small_stem: bool = False):
        super().__init__()
        import torchvision

        trunk = getattr(torchvision.models, arch)(weights=None)
        if small_stem:
            trunk.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            trunk.maxpool = nn.Identity()
        self.num_features = trunk.fc.in_features
        trunk.fc = nn.Identity()
        self.backbone = trunk
        self.head = nn.Linear(self.num_features, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))


class TinyCNN(nn.Module):
    """A four-layer CNN for tests, benchmarks and quick looks (≈100k parameters)."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.backbone = nn.Sequential(
            block(3, width),
            block(width, 2 * width),
            block(2 * width, 2 * width),
            block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.num_features = 4 * width
        self.head = nn.Linear(self.num_features, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))


class TimmClassifier(nn.Module):
    """A timm model (e.g. a ViT) behind the same ``forward_features``/``head`` interface."""

    def __init__(self, timm_name: str, num_classes: int, image_size: int, **kwargs):
        super().__init__()
        import timm

        self.backbone = timm.create_model(
            timm_name, pretrained=False, num_classes=0, img_size=image_size, **kwargs
        )
        self.num_features = self.backbone.num_features
        self.head = nn.Linear(self.num_features, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)  # pooled features (num_classes=0 removes timm's head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))


@register_model("resnet18")
def resnet18(num_classes: int, image_size: int = 64, **_) -> nn.Module:
    return ResNetClassifier("resnet18", num_classes, small_stem=image_size < 48)


@register_model("resnet50")
def resnet50(num_classes: int, image_size: int = 64, **_) -> nn.Module:
    return ResNetClassifier("resnet50", num_classes, small_stem=image_size < 48)


@register_model("tiny-cnn")
def tiny_cnn(num_classes: int, image_size: int = 64, **_) -> nn.Module:
    return TinyCNN(num_classes)


# The registered ViTs (timm VisionTransformer; average pooling unless vit-pool="token").  The masked-image-modelling
# methods (fedderm.mae, fedderm.beit) build their encoders from the same table, so a pre-trained
# encoder always fits the classifier of the same name.  ``vit-micro`` is for tests and quick looks.
VIT_ARCHS: dict[str, dict[str, int]] = {
    "vit-micro": {"embed_dim": 64, "depth": 2, "num_heads": 2, "patch_size": 8},
    "vit-tiny": {"embed_dim": 192, "depth": 12, "num_heads": 3, "patch_size": 8},
    "vit-small": {"embed_dim": 384, "depth": 12, "num_heads": 6, "patch_size": 8},
    "vit-base": {"embed_dim": 768, "depth": 12, "num_heads": 12, "patch_size": 16},
}


def vit_arch(name: str) -> dict[str, int]:
    """Encoder sizes of the registered ViT ``name`` (embed_dim, depth, num_heads, patch_size)."""
    if name not in VIT_ARCHS:
        raise ValueError(
            f"model {name!r} is not a ViT; the masked-image-modelling methods need one of "
            f"{', '.join(VIT_ARCHS)} (run-config key 'model')"
        )
    return dict(VIT_ARCHS[name])


#: What a registered ViT classifies (run-config key ``vit-pool``): ``avg``, the mean of the patch
#: tokens' outputs (MAE's fine-tuning default), or ``token``, the class token's output, "the visual
#: representation of the input image" of 000 §IV-A.
VIT_POOLS = ("avg", "token")


def _vit(name: str):
    def build(num_classes: int, image_size: int = 64, vit_pool: str = "avg", **_) -> nn.Module:
        arch = vit_arch(name)
        if image_size % arch["patch_size"]:
            raise ValueError(
                f"image-size {image_size} is not a multiple of the patch size {arch['patch_size']}"
            )
        if vit_pool not in VIT_POOLS:
            raise ValueError(f"run-config key 'vit-pool' must be one of {list(VIT_POOLS)}, got {vit_pool!r}")
        return TimmClassifier("vit_tiny_patch16_224", num_classes, image_size, global_pool=vit_pool, **arch)

    return build


for _name in VIT_ARCHS:
    register_model(_name)(_vit(_name))
