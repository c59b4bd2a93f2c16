"""MoCo v3 (Chen, Xie & He, ICCV 2021, "An empirical study of training self-supervised vision
transformers"): the local model of FedMoCo-v3 (paper 003 §IV-C4 baseline, ViT-B).

- Query encoder: ``backbone`` f_q (a ViT: ``create_model(cfg.model).backbone``, so it transfers to
  fine-tuning), ``projector`` g_q (3-layer MLP, hidden 4096, output 256, BN on every layer, the last
  without affine parameters) and ``predictor`` (2-layer MLP, 4096 → 256, MoCo v3 §4 and its
  reference code for ViTs).
- Momentum (key) encoder: ``momentum_backbone`` + ``momentum_projector``, no gradient, updated by
  θ_k ← m θ_k + (1 − m) θ_q before every key computation (MoCo v3 Alg. 1).
- No queue: the keys of the other images of the mini-batch are the negatives (Alg. 1):
  ctr(q, k) = CrossEntropy(q·kᵀ/τ, labels = arange(N)) · 2τ on L2-normalised q, k, and the
  symmetrised loss L = ctr(q1, k2) + ctr(q2, k1) (MoCo v3 Eq. 1 and Alg. 1; τ = 0.2 for ViTs in the
  reference code's ViT recipes).
- Random patch projection (§5.2): the ViT's patch embedding is frozen at its random init
  (``freeze_patch_embed``), the reference's stability trick for ViTs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .augment import ContrastiveAugment
from .byol import HIDDEN_DIM, PROJ_DIM, mlp
from .moco import two_views
from .models import create_model
from .train import train_epochs


class MoCoV3(nn.Module):
    def __init__(self, backbone: nn.Module, num_features: int, hidden_dim: int, proj_dim: int):
        super().__init__()
        self.backbone = backbone
        self.projector = mlp(num_features, hidden_dim, proj_dim, layers=3, last_bn=True)
        self.predictor = mlp(proj_dim, hidden_dim, proj_dim, layers=2, last_bn=True)
        self.momentum_backbone = copy.deepcopy(backbone)
        self.momentum_projector = copy.deepcopy(self.projector)
        for p in self.momentum_parameters():
            p.requires_grad_(False)

    def momentum_parameters(self) -> list[nn.Parameter]:
        return [*self.momentum_backbone.parameters(), *self.momentum_projector.parameters()]

    def trainable_parameters(self, freeze_patch_embed: bool = True) -> list[nn.Parameter]:
        """The query encoder and predictor, without the patch embedding when it is frozen."""
        frozen = (
            {id(p) for n, p in self.backbone.named_parameters() if n.startswith("patch_embed.")}
            if freeze_patch_embed
            else set()
        )
        params = [*self.backbone.parameters(), *self.projector.parameters(), *self.predictor.parameters()]
        return [p for p in params if id(p) not in frozen]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """q: the query encoder's prediction (N, proj_dim), not normalised."""
        return self.predictor(self.projector(self.backbone(x)))

    @torch.no_grad()
    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """k: the momentum encoder's projection (N, proj_dim), no gradient."""
        return self.momentum_projector(self.momentum_backbone(x))

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """θ_k ← m θ_k + (1 − m) θ_q (MoCo v3 Alg. 1)."""
        query = [*self.backbone.parameters(), *self.projector.parameters()]
        for pk, pq in zip(self.momentum_parameters(), query):
            pk.mul_(m).add_(pq.detach(), alpha=1 - m)


def build_mocov3(
    model_name: str, image_size: int, hidden_dim: int = HIDDEN_DIM, proj_dim: int = PROJ_DIM
) -> MoCoV3:
    """MoCo v3 around the backbone of ``create_model(model_name)`` (random init; seed the caller);
    the momentum encoder starts as a copy of the query encoder."""
    base = create_model(model_name, num_classes=1, image_size=image_size)
    return MoCoV3(base.backbone, base.num_features, hidden_dim, proj_dim)


def ctr(q: torch.Tensor, k: torch.Tensor, temperature: float) -> torch.Tensor:
    """MoCo v3 Alg. 1: CrossEntropy(q̄·k̄ᵀ/τ, arange(N)) · 2τ; the positive of query i is key i, the
    other N − 1 keys of the batch are its negatives (no queue)."""
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    logits = q @ k.T / temperature
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device)) * (2 * temperature)


def mocov3_loss(
    q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, temperature: float
) -> torch.Tensor:
    """The symmetrised loss ctr(q1, k2) + ctr(q2, k1) (Alg. 1)."""
    return ctr(q1, k2.detach(), temperature) + ctr(q2, k1.detach(), temperature)


def mocov3_round(
    model: MoCoV3,
    images: torch.Tensor,
    *,
    temperature: float,
    key_momentum: float,
    freeze_patch_embed: bool = True,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    betas: tuple[float, float] = (0.9, 0.999),
) -> dict[str, float]:
    """One round of local MoCo v3 on ``images`` (uint8, labels unused): two augmented views per
    image (:class:`fedderm.augment.ContrastiveAugment`), the symmetrised loss with in-batch keys."""
    device = torch.device(device)
    augment = ContrastiveAugment(images.shape[-1])

    def loss_fn(model: MoCoV3, xb, _yb, generator):
        x1, x2 = two_views(xb, augment, generator, device)
        q1, q2 = model(x1), model(x2)
        model.momentum_update(key_momentum)
        return mocov3_loss(q1, q2, model.keys(x1), model.keys(x2), temperature)

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
        params=model.trainable_parameters(freeze_patch_embed),
        betas=betas,
    )
