"""SimCLR (Chen et al. 2020): the FedSimCLR baseline of paper 000 §V-A.

Encoder ``backbone`` (the structure of ``create_model(cfg.model).backbone``, so it transfers to
fine-tuning) + 2-layer MLP ``head`` to 128-d; NT-Xent loss with the other images of the
mini-batch as negatives; same augmentation family as MoCo (:mod:`fedderm.augment`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .augment import ContrastiveAugment
from .moco import FEATURE_DIM, ProjectionHead, two_views
from .models import create_model
from .train import train_epochs


class SimCLR(nn.Module):
    def __init__(self, backbone: nn.Module, num_features: int, dim: int = FEATURE_DIM):
        super().__init__()
        self.backbone = backbone
        self.head = ProjectionHead(num_features, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised projections z (N, dim)."""
        return F.normalize(self.head(self.backbone(x)), dim=1)


def build_simclr(model_name: str, image_size: int, dim: int = FEATURE_DIM) -> SimCLR:
    base = create_model(model_name, num_classes=1, image_size=image_size)
    return SimCLR(base.backbone, base.num_features, dim)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """NT-Xent (SimCLR Eq. 1), mean over the 2N anchors: for view i the positive is the other
    view of the same image, the negatives are the 2N − 2 views of the other images."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = len(z1)
    self_pairs = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    sim = (z @ z.T / temperature).masked_fill(self_pairs, float("-inf"))  # not its own negative
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def simclr_round(
    model: SimCLR,
    images: torch.Tensor,
    *,
    temperature: float,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """One round of local SimCLR on ``images`` (uint8, labels unused)."""
    device = torch.device(device)
    augment = ContrastiveAugment(images.shape[-1])

    def loss_fn(model, xb, _yb, generator):
        x1, x2 = two_views(xb, augment, generator, device)
        return nt_xent(model(x1), model(x2), temperature)

    return train_epochs(
        model,
        images,
        torch.zeros(len(images), dtype=torch.long),
        loss_fn,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        seed=seed,
        device=device,
    )
