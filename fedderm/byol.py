"""BYOL (Grill et al. 2020, "Bootstrap your own latent"): the local model of FedBYOL and FedEMA
(paper 003 §IV-C4 baselines; FedEMA: Zhuang et al., ICLR 2022).

- Online network: ``backbone`` f_θ (the structure of ``create_model(cfg.model).backbone``, so it
  transfers to fine-tuning), ``projector`` g_θ and ``predictor`` q_θ, both
  Linear–BN–ReLU–Linear MLPs (BYOL §3.3: hidden 4096, output 256).
- Target network: ``target_backbone`` f_ξ + ``target_projector`` g_ξ, no gradient, updated after
  every step by ξ ← τ ξ + (1 − τ) θ (BYOL Eq. 1 of §3.1).
- Loss (BYOL Eq. 2): with q = q_θ(g_θ(f_θ(v))) and z' = g_ξ(f_ξ(v')) L2-normalised,
  L_θ,ξ = ‖q̄ − z̄'‖² = 2 − 2·⟨q, z'⟩ / (‖q‖·‖z'‖); symmetrised over the two views (Eq. 3:
  L + L̃, v and v' swapped), averaged over the mini-batch.

What the server averages (FedBYOL, FedEMA) is the online network only (:data:`ONLINE_PREFIXES`,
:func:`online_state`); the target network stays on the client, as in FedEMA's framework
("aggregate online encoder", the target kept local).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .augment import ContrastiveAugment
from .moco import two_views
from .models import create_model
from .train import train_epochs

#: BYOL §3.3: "a multi-layer perceptron ... hidden layer of size 4096 ... output of size 256"
HIDDEN_DIM, PROJ_DIM = 4096, 256
#: the keys of the online network (what a client sends and the server averages)
ONLINE_PREFIXES = ("backbone.", "projector.", "predictor.")


def mlp(in_dim: int, hidden_dim: int, out_dim: int, layers: int = 2, last_bn: bool = False) -> nn.Sequential:
    """``layers`` Linear layers with BatchNorm + ReLU between them (BYOL §3.3, MoCo v3 §4);
    ``last_bn``: a BatchNorm without affine parameters after the last one (MoCo v3's projector)."""
    mods: list[nn.Module] = []
    dims = [in_dim] + [hidden_dim] * (layers - 1) + [out_dim]
    for i in range(layers):
        last = i == layers - 1
        mods.append(nn.Linear(dims[i], dims[i + 1], bias=last and not last_bn))
        if not last:
            mods += [nn.BatchNorm1d(dims[i + 1]), nn.ReLU(inplace=True)]
        elif last_bn:
            mods.append(nn.BatchNorm1d(dims[i + 1], affine=False))
    return nn.Sequential(*mods)


class BYOL(nn.Module):
    """Online network (backbone, projector, predictor) and target network (EMA of the online
    backbone and projector)."""

    def __init__(self, backbone: nn.Module, num_features: int, hidden_dim: int, proj_dim: int):
        super().__init__()
        self.backbone = backbone
        self.projector = mlp(num_features, hidden_dim, proj_dim)
        self.predictor = mlp(proj_dim, hidden_dim, proj_dim)
        self.target_backbone = copy.deepcopy(backbone)
        self.target_projector = copy.deepcopy(self.projector)
        for p in self.target_parameters():
            p.requires_grad_(False)

    def online_parameters(self) -> list[nn.Parameter]:
        return [*self.backbone.parameters(), *self.projector.parameters(), *self.predictor.parameters()]

    def target_parameters(self) -> list[nn.Parameter]:
        return [*self.target_backbone.parameters(), *self.target_projector.parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """q_θ(z_θ): the online prediction (N, proj_dim), not normalised."""
        return self.predictor(self.projector(self.backbone(x)))

    @torch.no_grad()
    def target(self, x: torch.Tensor) -> torch.Tensor:
        """z'_ξ: the target projection (N, proj_dim), no gradient."""
        return self.target_projector(self.target_backbone(x))

    @torch.no_grad()
    def momentum_update(self, tau: float) -> None:
        """ξ ← τ ξ + (1 − τ) θ (BYOL §3.1) for the backbone and projector weights; BatchNorm
        statistics of the target network are its own (running on the target's forward passes)."""
        online = [*self.backbone.parameters(), *self.projector.parameters()]
        for t, o in zip(self.target_parameters(), online):
            t.mul_(tau).add_(o.detach(), alpha=1 - tau)

    @torch.no_grad()
    def reset_target(self) -> None:
        """ξ ← θ: the target network a copy of the online backbone and projector (weights and
        BatchNorm statistics), as at BYOL's initialisation."""
        self.target_backbone.load_state_dict(self.backbone.state_dict())
        self.target_projector.load_state_dict(self.projector.state_dict())


def build_byol(
    model_name: str, image_size: int, hidden_dim: int = HIDDEN_DIM, proj_dim: int = PROJ_DIM
) -> BYOL:
    """BYOL around the backbone of ``create_model(model_name)`` (random init; seed the caller)."""
    base = create_model(model_name, num_classes=1, image_size=image_size)
    return BYOL(base.backbone, base.num_features, hidden_dim, proj_dim)


def online_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The online network's entries of a :class:`BYOL` state dict (what is sent and averaged)."""
    return {k: v for k, v in state.items() if k.startswith(ONLINE_PREFIXES)}


def regression_loss(q: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """BYOL Eq. 2 per sample: ‖q̄ − z̄‖² = 2 − 2·⟨q, z⟩ / (‖q‖₂·‖z‖₂), shape (N,)."""
    return 2 - 2 * (F.normalize(q, dim=1) * F.normalize(z, dim=1)).sum(dim=1)


def byol_loss(q1: torch.Tensor, q2: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """BYOL's symmetric loss L + L̃ (Eq. 2–3), averaged over the batch: the prediction of each view
    regresses the target projection of the other view (``z1``, ``z2`` carry no gradient)."""
    return (regression_loss(q1, z2.detach()) + regression_loss(q2, z1.detach())).mean()


def byol_round(
    model: BYOL,
    images: torch.Tensor,
    *,
    tau: float,
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
    """One round of local BYOL on ``images`` (uint8, labels unused): per mini-batch, two augmented
    views (the MoCo v2 family of :class:`fedderm.augment.ContrastiveAugment`), the symmetric loss,
    an optimiser step on the online network, and the target update with ``tau`` (made before the
    target's forward pass of the next step, as MoCo's key-encoder update)."""
    device = torch.device(device)
    augment = ContrastiveAugment(images.shape[-1])

    def loss_fn(model: BYOL, xb, _yb, generator):
        x1, x2 = two_views(xb, augment, generator, device)
        q1, q2 = model(x1), model(x2)
        model.momentum_update(tau)
        return byol_loss(q1, q2, model.target(x1), model.target(x2))

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
        params=model.online_parameters(),
        betas=betas,
    )
