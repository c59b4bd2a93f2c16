"""FL-BT (paper 004 §III-B) and its model-level baselines MOON and FedBN (pure PyTorch).

* :class:`ProjectedNet` -- encoder + projector + output layer (004 Fig. 4; the MOON network):
  ``forward_features`` is R_w(x), the representation z before the output layer.
* :func:`train_flbt` -- local training with L = CE + μ·L_BT(z_local, z_global) (Eq. 4-8).
* :func:`train_moon` -- local training with L = CE + μ·ℓ_con(z, z_glob, z_prev) (MOON Eq. 3-4).
* :func:`batchnorm_keys` -- the state-dict keys FedBN keeps local (every BatchNorm module).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .augment import Augment
from .data import TensorBatches
from .losses import barlow_twins, moon_contrastive
from .models import create_model
from .train import Amp, RoundStats, make_optimizer, random_flips, to_channels_last, to_input

__all__ = [
    "ProjectedNet",
    "build_projected_net",
    "frozen_copy",
    "train_flbt",
    "train_moon",
    "train_with_model_term",
    "batchnorm_keys",
    "split_state",
]


class ProjectedNet(nn.Module):
    """Base encoder -> projector (Linear D→D, ReLU, Linear D→H) -> output layer (Linear H→C).

    The encoder is any :mod:`fedderm.models` model with its head removed; z = projector(encoder(x))
    is H-dimensional (H = 128 reproduces 004 Table XII: ResNet-50 + projector = 27.97 M parameters).
    """

    def __init__(self, encoder: nn.Module, num_classes: int, proj_dim: int = 128):
        super().__init__()
        dim = encoder.num_features
        encoder.head = nn.Identity()
        self.encoder = encoder
        self.projector = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, proj_dim))
        self.head = nn.Linear(proj_dim, num_classes)
        self.num_features = proj_dim

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """z = R_w(x): the representation before the output layer."""
        return self.projector(self.encoder.forward_features(x))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.forward_features(x)
        return self.head(z), z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))


def build_projected_net(model: str, num_classes: int, image_size: int, proj_dim: int = 128) -> ProjectedNet:
    """:class:`ProjectedNet` on the :mod:`fedderm.models` backbone ``model`` (random weights)."""
    return ProjectedNet(
        create_model(model, num_classes=num_classes, image_size=image_size), num_classes, proj_dim
    )


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode with no trainable parameter (the round's global model)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def train_with_model_term(
    model: ProjectedNet,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    term: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    augment: Augment = random_flips,
    precision: str | None = None,
) -> dict[str, float]:
    """Cross-entropy training plus ``term(x, z_local)`` per mini-batch.

    Batches, augmentation (``augment``, default flips), optimiser and the skip of one-image batches are those of
    :func:`fedderm.train.train_supervised`, so with ``term`` contributing zero the weights are
    identical to it (same seed).  Returns ``train_loss`` (mean total loss of the last epoch),
    ``train_term`` (mean of ``term``) and ``num-examples``.
    """
    device = torch.device(device)
    to_channels_last(model.to(device), device).train()
    opt = make_optimizer(
        [p for p in model.parameters() if p.requires_grad], optimizer, lr, momentum, weight_decay
    )
    amp = Amp(device, precision)  # the run's precision (fedderm.train.use_precision)
    batches = TensorBatches(images, labels, batch_size, shuffle=True, seed=seed, device=device)
    flips = torch.Generator().manual_seed(seed + 1)
    loss_sum = term_sum = 0.0
    seen = 0
    with RoundStats(model, epochs) as stats:  # the run's bn-stats (fedderm.train.use_bn_stats)
        for epoch in range(epochs):
            loss_sum = term_sum = 0.0
            seen = 0
            for xb, yb in batches:
                if len(yb) < 2:  # a batch of one breaks BatchNorm statistics
                    continue
                stats.before_batch(epoch)
                x = to_input(augment(xb, flips), device)
                y = yb.to(device)
                with amp.autocast():
                    logits, z = model.forward_with_features(x)
                    loss = F.cross_entropy(logits, y)
                    if term is not None:
                        extra = term(x, z)
                        loss = loss + extra
                        term_sum += extra.item() * len(yb)
                opt.zero_grad(set_to_none=True)
                amp.step(loss, opt)
                loss_sum += loss.item() * len(yb)
                seen += len(yb)
    return {
        "train_loss": loss_sum / max(seen, 1),
        "train_term": term_sum / max(seen, 1),
        "num-examples": int(len(labels)),
    }


def train_flbt(
    model: ProjectedNet,
    reference: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    mu: float,
    lambd: float,
    normalize: str = "paper",
    **kwargs,
) -> dict[str, float]:
    """FL-BT local training (Algorithm 1 of 004): L_n = CE(F(x), y) + μ·L_BT(z_local, z_global)
    (Eq. 7), z_global = R_{w^t}(x) from ``reference``, the frozen global model of this round."""
    device = torch.device(kwargs.get("device", "cpu"))
    reference.to(device).eval()

    def bt_term(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z_global = reference.forward_features(x)
        return mu * barlow_twins(z, z_global, lambd, normalize)

    return train_with_model_term(model, images, labels, term=bt_term, **kwargs)


def train_moon(
    model: ProjectedNet,
    reference: nn.Module,
    previous: nn.Module | None,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    mu: float,
    tau: float,
    **kwargs,
) -> dict[str, float]:
    """MOON local training: CE + μ·ℓ_con, positive = the global model's z, negative = the previous
    local model's z.  Without a previous model (first round) ℓ_con has no negative and is 0,
    as in MOON's reference code, so the loss is plain CE."""
    if previous is None:
        return train_with_model_term(model, images, labels, term=None, **kwargs)
    device = torch.device(kwargs.get("device", "cpu"))
    reference.to(device).eval()
    previous.to(device).eval()

    def moon_term(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z_glob, z_prev = reference.forward_features(x), previous.forward_features(x)
        return mu * moon_contrastive(z, z_glob, z_prev, tau)

    return train_with_model_term(model, images, labels, term=moon_term, **kwargs)


def batchnorm_keys(model: nn.Module) -> set[str]:
    """State-dict keys of every BatchNorm module (chosen by type, ``_BatchNorm``, not by name:
    ResNet's ``downsample.1`` is a BatchNorm too): weights, biases and running statistics."""
    keys = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            keys.update(f"{name}.{k}" if name else k for k in module.state_dict())
    return keys


def split_state(state: dict[str, torch.Tensor], local_keys: set[str]) -> tuple[dict, dict]:
    """(shared, local) parts of a state dict."""
    shared = {k: v for k, v in state.items() if k not in local_keys}
    local = {k: v for k, v in state.items() if k in local_keys}
    return shared, local
