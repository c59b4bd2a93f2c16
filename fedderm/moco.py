"""MoCo (He et al. 2020; v2 head and augmentations) as the local model of FedCLF (paper 000 §III,
001 §IV), with the negatives banks of FedCLF.

- :class:`MoCo`: main encoder (``backbone`` + 2-layer MLP ``head`` to 128-d) and momentum encoder
  (``momentum_backbone`` + ``momentum_head``, an exponential moving average of the main one).
  ``backbone`` has the structure of ``create_model(cfg.model).backbone``, so it transfers to
  fine-tuning.  The module holds no queue: the banks are :class:`FeatureQueue` objects the
  client keeps in ``context.state``, so ``state_dict()`` — what is sent and averaged — never
  contains them.
- :func:`info_nce`: Eq. 1/6.
- :func:`moco_round`: one round of local contrastive learning with the negatives of Eq. 3–5.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .augment import ContrastiveAugment
from .models import create_model
from .train import MEAN, STD, train_epochs

FEATURE_DIM = 128  # 000 §V-A: "a 2-layer MLP projection head ... to 128-dimensional features"


class ProjectionHead(nn.Sequential):
    """2-layer MLP (Linear–ReLU–Linear) from the backbone's D features to ``out_dim`` (MoCo v2)."""

    def __init__(self, in_dim: int, out_dim: int = FEATURE_DIM, hidden_dim: int | None = None):
        hidden_dim = hidden_dim or in_dim
        super().__init__(nn.Linear(in_dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, out_dim))


class MoCo(nn.Module):
    """Main and momentum encoders; ``forward`` gives the main encoder's L2-normalised features."""

    def __init__(self, backbone: nn.Module, num_features: int, dim: int = FEATURE_DIM):
        super().__init__()
        self.backbone = backbone
        self.head = ProjectionHead(num_features, dim)
        self.momentum_backbone = copy.deepcopy(backbone)
        self.momentum_head = copy.deepcopy(self.head)
        for p in self.momentum_parameters():
            p.requires_grad_(False)

    def main_parameters(self):
        return [*self.backbone.parameters(), *self.head.parameters()]

    def momentum_parameters(self):
        return [*self.momentum_backbone.parameters(), *self.momentum_head.parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """q: L2-normalised main-encoder features (N, dim)."""
        return F.normalize(self.head(self.backbone(x)), dim=1)

    @torch.no_grad()
    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """k: L2-normalised momentum-encoder features (N, dim), no gradient."""
        return F.normalize(self.momentum_head(self.momentum_backbone(x)), dim=1)

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """θ_k ← m θ_k + (1 − m) θ_q (MoCo's key-encoder update)."""
        for pk, pq in zip(self.momentum_parameters(), self.main_parameters()):
            pk.mul_(m).add_(pq.detach(), alpha=1 - m)


def build_moco(model_name: str, image_size: int, dim: int = FEATURE_DIM) -> MoCo:
    """MoCo around the backbone of ``create_model(model_name)`` (random init; seed the caller)."""
    base = create_model(model_name, num_classes=1, image_size=image_size)
    return MoCo(base.backbone, base.num_features, dim)


def info_nce(q: torch.Tensor, k: torch.Tensor, negatives: torch.Tensor, temperature: float) -> torch.Tensor:
    """Eq. 1/6 of 000: mean over the batch of
    −log exp(q·k⁺/τ) / (exp(q·k⁺/τ) + Σ_{n∈Q} exp(q·n/τ)).

    ``q``, ``k``: (N, d) features of two views of the same N images; ``negatives``: (M, d).
    """
    pos = (q * k).sum(dim=1, keepdim=True)
    logits = torch.cat([pos, q @ negatives.T], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))


class FeatureQueue:
    """First-in-first-out bank of at most ``capacity`` features (MoCo's queue).

    Until it is full it grows; then each new feature replaces the oldest.  ``ordered()`` gives
    the features oldest first, so ``FeatureQueue(capacity, dim, q.ordered(), ids=q.ordered_ids())``
    restores ``q``.  Each row also keeps the index of the image it came from (``ids``, -1 when
    unknown, e.g. remote features): the client's own bookkeeping for the leakage audit
    (:mod:`fedderm.leakage`), never uploaded.
    """

    def __init__(
        self,
        capacity: int,
        dim: int,
        features: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        ids: torch.Tensor | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.buffer = torch.zeros(capacity, dim, device=device)
        self.id_buffer = torch.full((capacity,), -1, dtype=torch.long)  # image index of each row
        self.ptr = 0  # next row to write
        self.size = 0
        if features is not None and len(features):
            self.enqueue(features.to(device=device, dtype=torch.float32), ids)

    def __len__(self) -> int:
        return self.size

    def features(self) -> torch.Tensor:
        """The stored features (any order); a copy, safe to keep while the queue moves on."""
        return self.buffer[: self.size].clone()

    def _oldest_first(self, buf: torch.Tensor) -> torch.Tensor:
        """The filled rows of ``buf`` (features or image ids), oldest first, as a copy."""
        if self.size < self.capacity:
            return buf[: self.size].clone()
        return torch.cat([buf[self.ptr :], buf[: self.ptr]])

    def ordered(self) -> torch.Tensor:
        """The stored features, oldest first."""
        return self._oldest_first(self.buffer)

    def image_ids(self) -> torch.Tensor:
        """The image index of every row of :meth:`features` (same order; -1 = unknown)."""
        return self.id_buffer[: self.size].clone()

    def ordered_ids(self) -> torch.Tensor:
        """The image index of every row of :meth:`ordered` (oldest first)."""
        return self._oldest_first(self.id_buffer)

    @torch.no_grad()
    def enqueue(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Append ``x`` (in order), dropping the oldest features beyond ``capacity``; ``ids``: the
        image index of each row (default -1, unknown)."""
        x = x.detach().to(self.buffer)[-self.capacity :]
        n = len(x)
        ids = torch.full((n,), -1, dtype=torch.long) if ids is None else ids.detach().long().cpu()[-n:]
        end = self.ptr + n
        if end <= self.capacity:
            self.buffer[self.ptr : end] = x
            self.id_buffer[self.ptr : end] = ids
        else:
            first = self.capacity - self.ptr
            self.buffer[self.ptr :] = x[:first]
            self.buffer[: n - first] = x[first:]
            self.id_buffer[self.ptr :] = ids[:first]
            self.id_buffer[: n - first] = ids[first:]
        self.ptr = end % self.capacity
        self.size = min(self.capacity, self.size + n)


def normalise_input(x: torch.Tensor) -> torch.Tensor:
    """[0, 1] images -> the network's input range (as :func:`fedderm.train.to_input`)."""
    return (x - MEAN) / STD


def two_views(
    images: torch.Tensor, augment: ContrastiveAugment, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independently augmented, normalised views of a uint8 batch."""
    x = images.to(device).float() / 255.0
    return normalise_input(augment(x, generator)), normalise_input(augment(x, generator))


@torch.no_grad()
def encode_keys(
    model: MoCo,
    images: torch.Tensor,
    limit: int,
    *,
    batch_size: int = 256,
    seed: int = 0,
    device: torch.device | str = "cpu",
    with_ids: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Momentum-encoder features of up to ``limit`` of the client's images (a seeded random subset,
    each an augmented view as during training): the initial local bank Q_l.  ``with_ids``: also the
    index of the image of every row."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=generator)[:limit]
    if with_ids:
        return encode_keys(model, images, limit, batch_size=batch_size, seed=seed, device=device), order
    augment = ContrastiveAugment(images.shape[-1])
    model.to(device).train()
    out = []
    for i in range(0, len(order), batch_size):
        x = images[order[i : i + batch_size]].to(device).float() / 255.0
        out.append(model.keys(normalise_input(augment(x, generator))))
    return torch.cat(out) if out else torch.empty(0, model.head[-1].out_features, device=device)


def moco_round(
    model: MoCo,
    images: torch.Tensor,
    local_bank: FeatureQueue,
    *,
    remote: torch.Tensor | None,
    feature_sharing: bool,
    local_negatives: bool,
    queue_size: int,
    temperature: float,
    key_momentum: float,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    on_batch: Callable[[FeatureQueue], None] | None = None,
) -> dict[str, float]:
    """One round of local contrastive learning on ``images`` (uint8, labels unused).

    Negatives Q_CL (capacity ``queue_size``), re-initialised every round:

    - ``feature_sharing=False`` (MoCo / FedMoCo): Q_CL = Q_l, the local keys enqueued after
      every mini-batch;
    - ``local_negatives=True`` (Eq. 4): Q_CL starts as Q_l; after every mini-batch of B images
      the B local keys and B remote features sampled uniformly from ``remote`` (Eq. 3) replace
      the oldest entries;
    - ``local_negatives=False`` (Eq. 5, 000's final method): Q_CL starts as (a uniform sample of
      at most ``queue_size`` of) the remote features and only remote features are enqueued.

    ``local_bank`` (Q_l) always receives the local keys (FIFO); it is what the client shares.
    ``on_batch(Q_CL)`` is called after each mini-batch's update (tests, diagnostics).
    Returns ``{"train_loss", "num-examples"}``.
    """
    device = torch.device(device)
    dim = local_bank.buffer.shape[1]
    sample_gen = torch.Generator().manual_seed(seed + 2)
    have_remote = remote is not None and len(remote) > 0
    if feature_sharing and not have_remote and not local_negatives:
        raise ValueError(
            "fedclf.local-negatives=false (Eq. 5) needs remote features, but this client "
            "received none (is it the only client?); set fedclf.local-negatives=true"
        )
    remote = remote.to(device=device, dtype=torch.float32) if have_remote else None

    if not feature_sharing or local_negatives:
        negatives = FeatureQueue(queue_size, dim, local_bank.ordered(), device=device)
    else:
        pick = torch.randperm(len(remote), generator=sample_gen)[:queue_size].to(device)
        negatives = FeatureQueue(queue_size, dim, remote[pick], device=device)

    def sample_remote(b: int) -> torch.Tensor:
        """Eq. 3: B indices uniform on [0, |Q_r| − 1]."""
        return remote[torch.randint(len(remote), (b,), generator=sample_gen).to(device)]

    augment = ContrastiveAugment(images.shape[-1])

    def loss_fn(model: MoCo, xb: torch.Tensor, idx, generator: torch.Generator) -> torch.Tensor:
        x_q, x_k = two_views(xb, augment, generator, device)
        q = model(x_q)
        model.momentum_update(key_momentum)
        k = model.keys(x_k)
        if len(negatives) == 0:
            raise ValueError("the negatives bank is empty (fedclf.queue-size and the client's data)")
        loss = info_nce(q, k, negatives.features(), temperature)
        if not feature_sharing:
            negatives.enqueue(k)
        elif local_negatives:
            negatives.enqueue(torch.cat([k, sample_remote(len(k))]) if have_remote else k)  # Eq. 4
        else:
            negatives.enqueue(sample_remote(len(k)))  # Eq. 5
        local_bank.enqueue(k, ids=idx)  # the "labels" are the image indices (below)
        if on_batch is not None:
            on_batch(negatives)
        return loss

    return train_epochs(
        model,
        images,
        torch.arange(len(images)),  # "labels" = image indices: Q_l knows which image each key came from
        loss_fn,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        seed=seed,
        device=device,
        params=model.main_parameters(),
    )
