"""Multi-task self-supervised pre-training on pseudo images (paper 004 §III-A, Fig. 2).

The server holds only the centres' generated images.  A shared backbone (the FL-BT encoder, so
its weights carry over key for key) feeds two heads, with hard parameter sharing:

* centre classification: which centre generated the image (CE, Eq. 1);
* restoration: the backbone sees a patch-swapped image and a decoder restores the original
  pseudo image (MSE, Eq. 2).

L_SSL = L_CE + L_MSE (Eq. 3).  Both heads read the features of the corrupted image (one forward
pass).  The decoder starts from the pooled feature vector, so any fedderm backbone works.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .augment import Augment
from .data import TensorBatches
from .losses import multitask_ssl_loss, patch_swap
from .models import create_model
from .msggan import scales_for
from .train import Amp, RoundStats, make_optimizer, random_flips, to_input

__all__ = [
    "MULTITASK_TASKS",
    "MultiTaskSSLNet",
    "pretrain_multitask",
    "train_multitask",
    "encoder_state",
    "original_ssl_network",
    "encoder_prefix",
    "backbone_arrays",
]

MULTITASK_TASKS = ("both", "centre", "restoration")


class MultiTaskSSLNet(nn.Module):
    """``encoder`` (a fedderm model without head) + centre-classification head + restoration decoder."""

    def __init__(self, model: str, num_centres: int, image_size: int, tasks: str = "both", width: int = 64):
        super().__init__()
        if tasks not in MULTITASK_TASKS:
            raise ValueError(f"ssl.tasks must be one of {list(MULTITASK_TASKS)}, got {tasks!r}")
        self.tasks = tasks
        self.encoder = create_model(model, num_classes=1, image_size=image_size)
        self.encoder.head = nn.Identity()
        dim = self.encoder.num_features
        self.centre_head = nn.Linear(dim, num_centres) if tasks in ("both", "centre") else None
        self.decoder = _decoder(dim, image_size, width) if tasks in ("both", "restoration") else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        h = self.encoder.forward_features(x)
        logits = self.centre_head(h) if self.centre_head is not None else None
        restored = self.decoder(h) if self.decoder is not None else None
        return logits, restored


def _decoder(dim: int, image_size: int, width: int) -> nn.Sequential:
    """Pooled features (B, D) -> image (B, 3, S, S) in [-1, 1] (the inputs' normalised range)."""
    scales = scales_for(image_size)
    s0 = scales[0]
    chans = [max(width // 2**i, 16) for i in range(len(scales))]
    layers: list[nn.Module] = [
        nn.Linear(dim, chans[0] * s0 * s0),
        nn.ReLU(inplace=True),
        nn.Unflatten(1, (chans[0], s0, s0)),
    ]
    for i in range(1, len(scales)):
        layers += [
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(chans[i - 1], chans[i], 3, padding=1),
            nn.BatchNorm2d(chans[i]),
            nn.ReLU(inplace=True),
        ]
    layers += [nn.Conv2d(chans[-1], 3, 3, padding=1), nn.Tanh()]
    return nn.Sequential(*layers)


def pretrain_multitask(
    images: torch.Tensor,
    centres: torch.Tensor,
    *,
    model: str,
    num_centres: int,
    tasks: str = "both",
    epochs: int = 5,
    batch_size: int = 32,
    lr: float = 1e-3,
    optimizer: str = "adam",
    patch: int = 0,
    swaps: int = 10,
    seed: int = 0,
    device: torch.device | str = "cpu",
    augment: Augment = random_flips,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Pre-train on pseudo images (uint8 (M, 3, S, S)) labelled by centre index (M,).

    ``patch`` = side of the swapped patches (0 -> S/8).  Returns the encoder's state dict (keys
    as in :class:`fedderm.flbt.ProjectedNet`'s ``encoder``) and the last epoch's mean losses.
    """
    torch.manual_seed(seed)
    net = MultiTaskSSLNet(model, num_centres, images.shape[-1], tasks)
    metrics = train_multitask(
        net,
        images,
        centres,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        patch=patch,
        swaps=swaps,
        seed=seed,
        device=device,
        augment=augment,
    )
    return encoder_state(net.state_dict()), metrics


def encoder_state(ssl_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``encoder.*`` part of a :class:`MultiTaskSSLNet` state dict, prefix removed (CPU copies)."""
    return {k[len("encoder.") :]: v.detach().cpu() for k, v in ssl_state.items() if k.startswith("encoder.")}


def train_multitask(
    net: MultiTaskSSLNet,
    images: torch.Tensor,
    centres: torch.Tensor | None = None,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "adam",
    patch: int = 0,
    swaps: int = 10,
    seed: int = 0,
    device: torch.device | str = "cpu",
    augment: Augment = random_flips,
    precision: str | None = None,
) -> dict[str, float]:
    """``epochs`` epochs of Eq. 3 (or the task ``net`` has) on uint8 images; ``centres`` may be None
    for restoration only (a centre pre-training on its own original images: SSL-Fed-R, FedSSL-R).
    Each batch is ``augment``-ed first (the run's pre-training policy; 004 §IV-B: 90° rotations and
    flips for all algorithms).
    Returns the last epoch's mean losses, ``num-examples`` and the time taken."""
    device = torch.device(device)
    size = images.shape[-1]
    patch = patch or max(size // 8, 1)
    if centres is None:
        if net.centre_head is not None:
            raise ValueError("centre classification needs the centre index of every image")
        centres = torch.zeros(len(images), dtype=torch.long)
    net.to(device).train()
    opt = make_optimizer(net.parameters(), optimizer, lr)
    amp = Amp(device, precision)  # the run's precision (fedderm.train.use_precision)
    batches = TensorBatches(images, centres, batch_size, shuffle=True, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    start = time.monotonic()
    sums = {"ssl_loss": 0.0, "ssl_ce": 0.0, "ssl_mse": 0.0}
    seen = correct = 0
    with RoundStats(net, epochs) as stats:  # the run's bn-stats (fedderm.train.use_bn_stats)
        for epoch in range(epochs):
            sums = dict.fromkeys(sums, 0.0)
            seen = correct = 0
            for xb, cb in batches:
                if len(cb) < 2:
                    continue
                stats.before_batch(epoch)
                original = to_input(augment(xb, g), device)
                corrupted = patch_swap(original, patch, swaps, g)
                c = cb.to(device)
                with amp.autocast():
                    logits, restored = net(corrupted)
                    loss = multitask_ssl_loss(logits, c, restored, original)
                logits = logits.float() if logits is not None else None
                restored = restored.float() if restored is not None else None
                opt.zero_grad(set_to_none=True)
                amp.step(loss, opt)
                n = len(cb)
                sums["ssl_loss"] += loss.item() * n
                if logits is not None:
                    sums["ssl_ce"] += nn.functional.cross_entropy(logits, c).item() * n
                    correct += int((logits.argmax(1) == c).sum())
                if restored is not None:
                    sums["ssl_mse"] += nn.functional.mse_loss(restored, original).item() * n
                seen += n
    metrics = {k: v / max(seen, 1) for k, v in sums.items()}
    metrics["ssl_centre_accuracy"] = correct / max(seen, 1) if net.centre_head is not None else float("nan")
    metrics["ssl_seconds"] = time.monotonic() - start
    metrics["num-examples"] = int(len(images))
    return metrics


def original_ssl_network(model: str, image_size: int, tasks: str) -> nn.Module:
    """The pre-training network for ``ssl.tasks`` on a centre's original images (004 Tables VIII-X):
    ``restoration`` = encoder + decoder of :class:`MultiTaskSSLNet` (SSL-Fed-R, FedSSL-R),
    ``simclr`` = encoder + projection head of :class:`fedderm.simclr.SimCLR` (SSL-Fed-S, FedSSL-S)."""
    if tasks == "simclr":
        from .simclr import build_simclr

        return build_simclr(model, image_size)
    if tasks != "restoration":
        raise ValueError(f"pre-training on original images runs 'restoration' or 'simclr', not {tasks!r}")
    return MultiTaskSSLNet(model, 1, image_size, "restoration")


def encoder_prefix(tasks: str) -> str:
    """Where the encoder's ``backbone.*`` keys sit in the pre-training network of ``tasks``."""
    return "" if tasks == "simclr" else "encoder."


def backbone_arrays(state: dict, prefix: str) -> dict:
    """The ``<prefix>backbone.*`` entries of ``state``, keyed as in ``ProjectedNet.encoder``
    (``backbone.*``); works on tensors and on Flower Arrays alike."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix + "backbone.")}
