"""Contrastive views: the MoCo v2 augmentation family (Chen et al. 2020, "Improved baselines
with momentum contrastive learning"), on batched tensors, sized for small images.

Every image of a batch draws its own parameters from a ``torch.Generator`` (torchvision's
``transforms.v2`` draws one set of parameters per call, i.e. per batch, and from the global RNG),
so a batch is augmented in a few vectorised operations and the same seed gives the same views:

- random resized crop, scale (0.2, 1), aspect ratio (3/4, 4/3), bilinear (``grid_sample``; a crop
  of at least 20 % of the area is enlarged, so no anti-aliasing is needed);
- horizontal and vertical flips (p = 0.5 each; lesions have no canonical orientation);
- colour jitter (p = 0.8): brightness, contrast, saturation 0.4, hue 0.1, in a random order per
  image (as ``v2.ColorJitter``); the hue shift is a rotation of the chroma plane in YIQ space;
- grayscale (p = 0.2);
- Gaussian blur (p = 0.5) with a kernel of about 10 % of the image side, and σ ∈ (0.1, 2.0)
  scaled by kernel/23 (MoCo v2's 23-px kernel at 224 px), so the blur is the same fraction of
  the image at any size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import AUGMENT_POLICIES

_GRAY = torch.tensor([0.299, 0.587, 0.114])
# RGB <-> YIQ (NTSC); hue shift = rotation of the (I, Q) chroma plane
_RGB2YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])


def _tf():
    """torchvision's ``transforms.v2.functional``, imported on first use: ``import torchvision`` also
    imports its models and ops (and with them ``torch._dynamo``), seconds that a ClientApp whose
    policy is ``flip`` (every method's default) need not spend at each start."""
    from torchvision.transforms.v2 import functional

    return functional


@functools.cache
def _yiq2rgb() -> torch.Tensor:
    """The inverse of ``_RGB2YIQ``, computed on first use: importing this module runs no torch op
    (the deployment accelerator imports the libraries once in a fork server, see fedderm.accel.forkserver)."""
    return torch.linalg.inv(_RGB2YIQ)


@dataclass(frozen=True)
class ContrastiveAugment:
    """Random views of a batch of images in [0, 1] (N×3×S×S float), per-image parameters."""

    size: int
    crop_scale: tuple[float, float] = (0.2, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    gray_p: float = 0.2
    blur_p: float = 0.5
    blur_sigma: tuple[float, float] = (0.1, 2.0)

    @property
    def blur_kernel(self) -> int:
        k = max(3, int(round(self.size / 10)))
        return k if k % 2 else k + 1

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        n = x.shape[0]

        def rand(*shape):  # parameters are drawn on the CPU generator, then moved
            return torch.rand(*shape, generator=generator).to(x.device)

        x = self.resized_crop(x, rand(n, 4))
        flip_h, flip_v = rand(n) < 0.5, rand(n) < 0.5
        x = torch.where(flip_h[:, None, None, None], x.flip(-1), x)
        x = torch.where(flip_v[:, None, None, None], x.flip(-2), x)
        x = self.color_jitter(
            x,
            rand(n) < self.jitter_p,
            rand(n, 4),
            torch.argsort(torch.rand(n, 4, generator=generator), dim=1).to(x.device),
        )
        gray = rand(n) < self.gray_p
        x = torch.where(gray[:, None, None, None], _tf().rgb_to_grayscale(x, num_output_channels=3), x)
        sigma = self.blur_sigma[0] + rand(n) * (self.blur_sigma[1] - self.blur_sigma[0])
        x = self.blur(x, rand(n) < self.blur_p, sigma * self.blur_kernel / 23)
        return x.clamp_(0.0, 1.0)

    def resized_crop(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Crop a random box per image (area share and log aspect ratio uniform) and resize to
        ``size`` × ``size``."""
        n, _, h, w = x.shape
        area = (self.crop_scale[0] + u[:, 0] * (self.crop_scale[1] - self.crop_scale[0])) * h * w
        log_r = math.log(self.crop_ratio[0]) + u[:, 1] * (
            math.log(self.crop_ratio[1]) - math.log(self.crop_ratio[0])
        )
        ratio = torch.exp(log_r)
        cw = torch.sqrt(area * ratio).clamp(1.0, w)
        ch = torch.sqrt(area / ratio).clamp(1.0, h)
        x0 = u[:, 2] * (w - cw)
        y0 = u[:, 3] * (h - ch)
        # affine map from the output square to the box, in grid_sample's [-1, 1] coordinates
        theta = torch.zeros(n, 2, 3, device=x.device, dtype=x.dtype)
        theta[:, 0, 0], theta[:, 0, 2] = cw / w, (2 * x0 + cw) / w - 1
        theta[:, 1, 1], theta[:, 1, 2] = ch / h, (2 * y0 + ch) / h - 1
        grid = F.affine_grid(theta, [n, x.shape[1], self.size, self.size], align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def color_jitter(
        self, x: torch.Tensor, apply: torch.Tensor, u: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        """Brightness, contrast, saturation, hue with per-image factors, in a per-image order."""
        b = 1 + (2 * u[:, 0] - 1) * self.brightness
        c = 1 + (2 * u[:, 1] - 1) * self.contrast
        s = 1 + (2 * u[:, 2] - 1) * self.saturation
        hue = (2 * u[:, 3] - 1) * self.hue
        ops = [
            lambda y, i: (y * b[i, None, None, None]).clamp(0, 1),
            lambda y, i: _blend(y, _gray(y).mean(dim=(-3, -2, -1), keepdim=True), c[i]),
            lambda y, i: _blend(y, _gray(y), s[i]),
            lambda y, i: _shift_hue(y, hue[i]),
        ]
        out = x.clone()
        for stage in range(4):
            for op_index, op in enumerate(ops):
                idx = torch.nonzero(apply & (order[:, stage] == op_index)).flatten()
                if len(idx):
                    out[idx] = op(out[idx], idx)
        return out

    def blur(self, x: torch.Tensor, apply: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Separable Gaussian blur with a per-image σ (reflect padding)."""
        idx = torch.nonzero(apply).flatten()
        if not len(idx):
            return x
        k = self.blur_kernel
        t = torch.arange(k, device=x.device, dtype=x.dtype) - (k - 1) / 2
        kernel = torch.exp(-(t[None] ** 2) / (2 * sigma[idx, None] ** 2))
        kernel = kernel / kernel.sum(1, keepdim=True)  # (m, k)
        sel = x[idx]
        m, ch, h, w = sel.shape
        weight = kernel.repeat_interleave(ch, 0)  # one kernel per (image, channel)
        y = F.pad(sel.reshape(1, m * ch, h, w), (k // 2, k // 2, k // 2, k // 2), mode="reflect")
        y = F.conv2d(y, weight[:, None, None, :], groups=m * ch)
        y = F.conv2d(y, weight[:, None, :, None], groups=m * ch)
        out = x.clone()
        out[idx] = y.reshape(m, ch, h, w)
        return out


def _gray(x: torch.Tensor) -> torch.Tensor:
    return (x * _GRAY.to(x)[None, :, None, None]).sum(1, keepdim=True)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    f = factor[:, None, None, None]
    return (f * x + (1 - f) * other).clamp(0, 1)


def _shift_hue(x: torch.Tensor, hue: torch.Tensor) -> torch.Tensor:
    """Rotate the chroma plane by ``hue`` turns (hue ∈ [-0.5, 0.5], as ``adjust_hue``)."""
    theta = 2 * math.pi * hue
    cos, sin = torch.cos(theta), torch.sin(theta)
    rot = torch.zeros(len(hue), 3, 3, device=x.device, dtype=x.dtype)
    rot[:, 0, 0] = 1
    rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = cos, -sin, sin, cos
    m = _yiq2rgb().to(x) @ rot @ _RGB2YIQ.to(x)  # (n, 3, 3)
    return torch.einsum("nij,njhw->nihw", m, x).clamp(0, 1)


# -- Non-contrastive augmentation policies per stage, named after the paper they come from --


def random_flips(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal and vertical flips per image (lesions have no canonical orientation)."""
    n = x.shape[0]
    h = (torch.rand(n, generator=generator) < 0.5).to(x.device)  # drawn on the CPU generator
    v = (torch.rand(n, generator=generator) < 0.5).to(x.device)
    x = x.clone()
    x[h] = x[h].flip(-1)
    x[v] = x[v].flip(-2)
    return x


STAGES = ("pretrain", "finetune")


@dataclass(frozen=True)
class Policy:
    """Random augmentation of a batch of uint8 images (N×C×S×S) with torchvision's ``transforms.v2``
    functionals, per-image parameters drawn from a ``torch.Generator`` (same seed, same images).

    In order: random resized crop (``crop_scale``, aspect ratio 3/4–4/3, back to S×S, bicubic, as
    ``v2.RandomResizedCrop``), horizontal flip (p = ½), vertical flip (p = ½), rotation by a multiple
    of 90° drawn uniformly from {0°, 90°, 180°, 270°} (``rot90``), rotation by a uniform angle in
    ±``degrees`` (nearest, fill 0, as ``v2.RandomRotation``), colour jitter of brightness, contrast
    and saturation by factors in [1 − ``jitter``, 1 + ``jitter``] in a random order (as
    ``v2.ColorJitter(jitter, jitter, jitter)``).
    """

    crop_scale: tuple[float, float] | None = None
    hflip: bool = True
    vflip: bool = False
    rot90: bool = False
    degrees: float = 0.0
    jitter: float = 0.0

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise TypeError(f"augmentation policies take uint8 images, got {x.dtype}")
        return torch.stack([self.one(img, generator) for img in x]) if len(x) else x.clone()

    def one(self, img: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        size = list(img.shape[-2:])
        TF = _tf()  # noqa: N806 - torchvision's usual alias
        if self.crop_scale is not None:
            top, left, h, w = crop_params(size, self.crop_scale, (3 / 4, 4 / 3), g)
            img = TF.resized_crop(
                img, top, left, h, w, size, interpolation=TF.InterpolationMode.BICUBIC, antialias=True
            )
        if self.hflip and _coin(g):
            img = TF.horizontal_flip(img)
        if self.vflip and _coin(g):
            img = TF.vertical_flip(img)
        if self.rot90:
            img = torch.rot90(img, int(torch.randint(4, (1,), generator=g)), dims=(-2, -1))
        if self.degrees:
            angle = float((2 * torch.rand(1, generator=g) - 1) * self.degrees)
            img = TF.rotate(img, angle, interpolation=TF.InterpolationMode.NEAREST, fill=0)
        if self.jitter:
            factors = 1 + (2 * torch.rand(3, generator=g) - 1) * self.jitter
            ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation)
            for i in torch.randperm(3, generator=g).tolist():
                img = ops[i](img, float(factors[i]))
        return img.contiguous()


def _coin(g: torch.Generator) -> bool:
    return bool(torch.rand(1, generator=g) < 0.5)


def crop_params(
    size: list[int], scale: tuple[float, float], ratio: tuple[float, float], g: torch.Generator
) -> tuple[int, int, int, int]:
    """``v2.RandomResizedCrop``'s box (top, left, height, width) drawn from ``g``: area share uniform in
    ``scale``, log aspect ratio uniform in ``ratio``, 10 tries, else the centre crop."""
    height, width = size
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(scale[0], scale[1], generator=g))
        aspect = math.exp(
            float(torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1]), generator=g))
        )
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


#: (paper, stage) -> policy.  ``flip``: fedderm's former default, flips only.  000 FedMAE §V-B "Following
#: [18] (MAE), random resized cropping and random horizontal flipping": MAE's ``main_pretrain.py``
#: RandomResizedCrop(scale=(0.2, 1)) and, for fine-tuning, timm's default crop scale (0.08, 1) of MAE's
#: ``main_finetune.py``.  003 §IV-B2: pre-training "random scaling [0.2, 1.0] and crop ..., random color
#: jittering and random horizontal flipping"; fine-tuning "random scaling [0.6, 1.0] and cropping ...,
#: random rotation with a degree of 10 and random horizontal flipping" (the non-COVID-FL ranges).
#: 004 §IV-B: "rotation (90°, 180°, 270°) and horizontally flipping", for all algorithms.
POLICIES: dict[tuple[str, str], Callable] = {
    ("flip", "pretrain"): random_flips,
    ("flip", "finetune"): random_flips,
    ("000", "pretrain"): Policy(crop_scale=(0.2, 1.0)),
    ("000", "finetune"): Policy(crop_scale=(0.08, 1.0)),
    ("003", "pretrain"): Policy(crop_scale=(0.2, 1.0), jitter=0.4),
    ("003", "finetune"): Policy(crop_scale=(0.6, 1.0), degrees=10.0),
    ("004", "pretrain"): Policy(rot90=True),
    ("004", "finetune"): Policy(rot90=True),
}


Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def policy(augment: str, stage: str, paper: str = "flip") -> Augment:
    """The policy of run-config ``augment`` for ``stage`` (``pretrain`` | ``finetune``); ``paper``
    (the method's own paper policy, ``Method.augment``) is what ``augment="paper"`` means."""
    name = paper if augment == "paper" else augment
    if (name, stage) not in POLICIES:
        raise ValueError(
            f"run-config key 'augment' must be one of {list(AUGMENT_POLICIES)} and stage one of "
            f"{list(STAGES)}, got augment={augment!r} (policy {name!r}), stage={stage!r}"
        )
    return POLICIES[name, stage]
