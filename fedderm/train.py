"""Local training and evaluation loops shared by every method (pure PyTorch)."""

from __future__ import annotations

import contextlib
import contextvars
import math
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .augment import Augment, random_flips
from .config import BN_STATS
from .data import TensorBatches
from .metrics import CONFUSION_KEY, classification_metrics, confusion

MEAN, STD = 0.5, 0.5


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but no CUDA device is available; use device='auto'")
    return torch.device(name)


#: values of the run-config key ``precision``: the autocast dtype of the local loops (None: float32)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_PRECISION: contextvars.ContextVar[str] = contextvars.ContextVar("fedderm_precision", default="fp32")


def check_precision(precision: str, device: torch.device | str) -> None:
    """Raise naming the run-config key when ``precision`` cannot run on ``device``: fp16 (autocast +
    GradScaler) is the CUDA path, bf16 the one that runs on both CPU and CUDA."""
    if precision not in PRECISIONS:
        raise ValueError(f"run-config key 'precision' must be one of {list(PRECISIONS)}, got {precision!r}")
    if precision == "fp16" and torch.device(device).type != "cuda":
        raise ValueError(
            f"run-config key 'precision' is \"fp16\", which needs a CUDA device, but this client runs on "
            f'{torch.device(device).type}: use precision="bf16" (works on CPU) or "fp32"'
        )


@contextlib.contextmanager
def use_precision(precision: str) -> Iterator[None]:
    """Every local loop started inside this block (in this thread) uses ``precision`` unless it is
    given one; the ClientApp wraps each message in it with the run's ``precision`` key."""
    token = _PRECISION.set(precision)
    try:
        yield
    finally:
        _PRECISION.reset(token)


class Amp:
    """Mixed precision of one local loop: ``autocast()`` around the forward pass and the loss, and
    ``step(loss, opt)`` for backward + optimiser step (a ``torch.amp.GradScaler`` with fp16, so that
    small float16 gradients do not underflow).  Parameters, optimiser state and BatchNorm statistics
    stay float32 (autocast casts only the inputs of matmuls/convolutions), so what is aggregated and
    sent stays float32.  ``precision`` defaults to the one set by :func:`use_precision`."""

    def __init__(self, device: torch.device | str, precision: str | None = None):
        self.device = torch.device(device)
        self.precision = _PRECISION.get() if precision is None else precision
        check_precision(self.precision, self.device)
        self.dtype = PRECISIONS[self.precision]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(
        self,
        loss: torch.Tensor,
        opt: torch.optim.Optimizer,
        after_backward: Callable[[], None] | None = None,
        update: bool = True,
    ) -> None:
        """backward, ``after_backward()`` on the unscaled gradients, optimiser step; ``update=False``
        when another optimiser steps later in the same iteration (e.g. a GAN's D then G)."""
        self.scaler.scale(loss).backward()
        if after_backward is not None:
            if self.scaler.is_enabled():
                self.scaler.unscale_(opt)
            after_backward()
        self.scaler.step(opt)
        if update:
            self.scaler.update()


_BN_STATS: contextvars.ContextVar[str] = contextvars.ContextVar("fedderm_bn_stats", default="round")


@contextlib.contextmanager
def use_bn_stats(mode: str) -> Iterator[None]:
    """Every local loop started inside this block (in this thread) keeps BatchNorm statistics by
    ``mode`` (:class:`RoundStats`); the ClientApp wraps each message in it with the run's ``bn-stats``."""
    if mode not in BN_STATS:
        raise ValueError(f"run-config key 'bn-stats' must be one of {list(BN_STATS)}, got {mode!r}")
    token = _BN_STATS.set(mode)
    try:
        yield
    finally:
        _BN_STATS.reset(token)


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """Every BatchNorm module of ``model`` that keeps running statistics (chosen by type, so
    ResNet's ``downsample.1`` and a MoCo key encoder's layers too)."""
    return [
        m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


class RoundStats:
    """The BatchNorm running statistics of one local loop (run-config ``bn-stats``).

    ``"round"``: at the first training batch of the loop's *last* epoch every BatchNorm layer's
    running mean and variance are reset and then accumulate as a cumulative average over that
    epoch's batches (``momentum=None``); each layer's momentum is restored when the loop ends.
    What is stored, sent, averaged and evaluated then describes the client's own training data
    under this round's weights, at no extra forward pass: the batch statistics are computed by the
    training forward passes anyway (train mode normalises with them, unchanged).  With PyTorch's
    exponential average (``"ema"``, momentum 0.1) a round of k steps keeps 0.9^k of the statistics
    the client received: with a few steps per round the model that is evaluated normalises with
    the initial values, averaged across clients by FedAvg (Wu & Johnson 2021, "Rethinking 'Batch'
    in BatchNorm", §3: EMA statistics lag the weights; a population estimate with fixed weights,
    PreciseBN, fixes it; the last epoch's average is its zero-cost approximation).

    Call :meth:`before_batch` with the epoch index before every training forward pass; use the
    object as a context manager so that the momenta come back even when the loop raises.
    """

    def __init__(self, model: nn.Module, epochs: int, mode: str | None = None):
        mode = _BN_STATS.get() if mode is None else mode
        if mode not in BN_STATS:
            raise ValueError(f"run-config key 'bn-stats' must be one of {list(BN_STATS)}, got {mode!r}")
        self.layers = batchnorm_layers(model) if mode == "round" else []
        self.last_epoch = epochs - 1
        self.momenta: list[float | None] | None = None

    def before_batch(self, epoch: int) -> None:
        if self.momenta is None and self.layers and epoch >= self.last_epoch:
            self.momenta = [m.momentum for m in self.layers]
            for m in self.layers:
                m.reset_running_stats()
                m.momentum = None  # cumulative moving average (1 / batches seen)

    def __enter__(self) -> RoundStats:
        return self

    def __exit__(self, *exc) -> bool:
        if self.momenta is not None:
            for m, momentum in zip(self.layers, self.momenta):
                m.momentum = momentum
        return False


def wants_channels_last(model: nn.Module, device: torch.device | str) -> bool:
    """Convolutional networks with BatchNorm (the ResNets, tiny-cnn) on CUDA: cuDNN's NHWC kernels
    (Tensor Cores) are faster there; ViTs (no BatchNorm2d) and every model on CPU keep NCHW."""
    return torch.device(device).type == "cuda" and any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def to_channels_last(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model`` in ``channels_last`` memory format where :func:`wants_channels_last` (in place).
    Only the strides change: state dicts hold the same values (``wire.to_array`` sends them
    C-contiguous), and the CPU path is untouched."""
    if wants_channels_last(model, device):
        model.to(memory_format=torch.channels_last)
    return model


class GpuPeak:
    """Peak CUDA memory of the work inside ``with GpuPeak(device) as peak:`` in MiB
    (``torch.cuda.max_memory_allocated``); ``peak.mib`` stays ``None`` off CUDA."""

    def __init__(self, device: torch.device | str, cuda=torch.cuda):
        self.device, self.cuda, self.mib = torch.device(device), cuda, None

    def __enter__(self):
        if self.device.type == "cuda":
            self.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.mib = round(self.cuda.max_memory_allocated(self.device) / 2**20, 1)
        return False


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch; same seed -> same numbers on CPU."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_input(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 N×3×S×S -> normalised float on ``device``."""
    return (images.to(device, non_blocking=True).float() / 255.0 - MEAN) / STD


def round_lr(
    base_lr: float, server_round: int, num_rounds: int, schedule: str = "cosine", decay: float = 0.998
) -> float:
    """Learning rate of federated round ``server_round`` (1-based): constant, cosine decay, or
    exponential decay base × decay^(r−1) (SiFT §2.4: 0.1 × 0.998 per round)."""
    if schedule == "exponential":
        return base_lr * decay ** (server_round - 1)
    if schedule == "constant" or num_rounds <= 1:
        return base_lr
    return base_lr * 0.5 * (1 + math.cos(math.pi * (server_round - 1) / num_rounds))


def epoch_lr(base_lr: float, epoch: float, total_epochs: float, warmup_epochs: float = 0.0) -> float:
    """Learning rate at (fractional) epoch ``epoch`` of ``total_epochs``: linear warm-up from 0 over
    ``warmup_epochs``, then half-cycle cosine to 0; the MAE/BEiT reference's
    ``util/lr_sched.adjust_learning_rate``, called every iteration with epoch = e + i / len(loader)
    (003 §IV-B3: "a warmup period of 10 epochs" (BEiT) / "5 epochs" (MAE), "cosine learning rate decay")."""
    if epoch < warmup_epochs:
        return base_lr * epoch / warmup_epochs
    if total_epochs <= warmup_epochs:
        return base_lr
    return base_lr * 0.5 * (1 + math.cos(math.pi * (epoch - warmup_epochs) / (total_epochs - warmup_epochs)))


def batch_scaled_lr(base_lr: float, batch_size: int) -> float:
    """lr = blr × batch / 256, the MAE/BEiT rule for a *base* learning rate (MAE ``main_pretrain.py``:
    ``args.lr = args.blr * eff_batch_size / 256``; 003 §IV-B3 and Table I give base rates η)."""
    return base_lr * batch_size / 256


def mim_schedule(
    base_lr: float,
    *,
    server_round: int,
    num_rounds: int,
    local_epochs: int,
    batch_size: int,
    lr_step: str = "round",
    warmup_epochs: float = 0,
    adam_beta2: float = 0.999,
    lr_scaling: str = "absolute",
    schedule: str = "cosine",
    decay: float = 0.998,
) -> dict:
    """The optimiser settings of one MAE/BEiT pre-training round (the ``mim.*`` keys), as keyword
    arguments of :func:`train_epochs`: ``lr`` (× batch/256 with ``lr_scaling="batch"``), ``betas``
    (0.9, ``adam_beta2``) and, with ``lr_step="iteration"``, ``lr_at_epoch``: :func:`epoch_lr` over
    the ``num_rounds × local_epochs`` epochs of the stage, this round covering epochs
    (r − 1)·E … r·E (the MAE/BEiT reference's per-iteration schedule)."""
    lr = batch_scaled_lr(base_lr, batch_size) if lr_scaling == "batch" else base_lr
    out: dict = {"betas": (0.9, adam_beta2)}
    if lr_step == "iteration":
        start, total = (server_round - 1) * local_epochs, num_rounds * local_epochs
        out["lr"] = epoch_lr(lr, start, total, warmup_epochs)
        out["lr_at_epoch"] = lambda e: epoch_lr(lr, start + e, total, warmup_epochs)
    else:
        out["lr"] = round_lr(lr, server_round, num_rounds, schedule, decay)
    return out


def make_optimizer(
    params,
    name: str,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.Optimizer:
    """SGD (with ``momentum``), Adam or AdamW (with ``betas``; MAE pre-trains with (0.9, 0.95))."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, betas=betas)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adam, adamw")


def proximal_term(model: nn.Module, reference: list[torch.Tensor]) -> torch.Tensor:
    """‖w − w_global‖² over trainable parameters (FedProx, Li et al. 2020, Eq. 2 without μ/2)."""
    return sum(((p - r) ** 2).sum() for p, r in zip(model.parameters(), reference) if p.requires_grad)


def train_epochs(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    loss_fn,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    params=None,
    after_backward: Callable[[nn.Module], None] | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    lr_at_epoch: Callable[[float], float] | None = None,
    precision: str | None = None,
    bn_stats: str | None = None,
) -> dict[str, float]:
    """The local loop every method shares: ``epochs`` passes of shuffled mini-batches.

    ``loss_fn(model, images_uint8, labels, generator)`` returns the batch loss (the method's
    objective; ``generator`` seeds its augmentations).  ``params`` defaults to every trainable
    parameter.  ``after_backward(model)`` runs between ``backward()`` and the optimiser step
    (e.g. SCAFFOLD's gradient correction).  ``lr_at_epoch(e + i / batches)`` (optional) sets the
    learning rate before every step, ``i`` counting the batches of local epoch ``e`` (a
    per-iteration schedule such as :func:`epoch_lr`); without it ``lr`` is constant.
    ``precision`` (default: :func:`use_precision`'s) runs ``loss_fn`` under autocast (:class:`Amp`).
    ``bn_stats`` (default: :func:`use_bn_stats`'s, ``"round"``) says what the BatchNorm running
    statistics hold afterwards (:class:`RoundStats`).
    Returns ``{"train_loss": mean loss of the last epoch, "num-examples": n}``.
    """
    device = torch.device(device)
    to_channels_last(model.to(device), device).train()
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    opt = make_optimizer(params, optimizer, lr, momentum, weight_decay, betas)
    amp = Amp(device, precision)
    batches = TensorBatches(images, labels, batch_size, shuffle=True, seed=seed, device=device)
    per_epoch = max(len(batches), 1)
    augment = torch.Generator().manual_seed(seed + 1)
    loss_sum, seen = 0.0, 0
    with RoundStats(model, epochs, bn_stats) as stats:
        for epoch in range(epochs):
            loss_sum, seen = 0.0, 0
            for step, (xb, yb) in enumerate(batches):
                if len(yb) < 2:  # a batch of one breaks BatchNorm statistics
                    continue
                stats.before_batch(epoch)
                if lr_at_epoch is not None:
                    for group in opt.param_groups:
                        group["lr"] = lr_at_epoch(epoch + step / per_epoch)
                with amp.autocast():
                    loss = loss_fn(model, xb, yb, augment)
                opt.zero_grad(set_to_none=True)
                amp.step(loss, opt, (lambda: after_backward(model)) if after_backward is not None else None)
                loss_sum += loss.item() * len(yb)
                seen += len(yb)
    opt.zero_grad(set_to_none=True)  # the gradients are not needed after training: free their memory
    return {"train_loss": loss_sum / max(seen, 1), "num-examples": int(len(labels))}


def train_supervised(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    proximal_mu: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    regularizer: Callable[[nn.Module], torch.Tensor] | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
    augment: Augment = random_flips,
    precision: str | None = None,
    bn_stats: str | None = None,
) -> dict[str, float]:
    """Cross-entropy training on ``augment``-ed images (default: random flips; the run's
    ``augment`` policy: :func:`fedderm.augment.policy`); with ``proximal_mu`` > 0 adds FedProx's
    (μ/2)‖w − w_global‖², w_global being the weights the model had on entry.

    ``regularizer(model)`` is added to every mini-batch loss (e.g. FedDyn's linear and quadratic
    terms); ``after_backward(model)`` runs between ``backward()`` and the optimiser step (e.g.
    SCAFFOLD's gradient correction).
    """
    device = torch.device(device)
    reference = [p.detach().clone().to(device) for p in model.parameters()] if proximal_mu > 0 else None

    def loss_fn(model, xb, yb, generator):
        loss = F.cross_entropy(model(to_input(augment(xb, generator), device)), yb.to(device))
        if reference is not None:
            loss = loss + proximal_mu / 2 * proximal_term(model, reference)
        if regularizer is not None:
            loss = loss + regularizer(model)
        return loss

    return train_epochs(
        model,
        images,
        labels,
        loss_fn,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        seed=seed,
        device=device,
        after_backward=after_backward,
        precision=precision,
        bn_stats=bn_stats,
    )


@torch.no_grad()
def predict(
    model: nn.Module,
    images: torch.Tensor,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    precision: str | None = None,
) -> torch.Tensor:
    """Softmax probabilities (N, C, float32) of the model in eval mode, the forward pass under
    ``precision`` (:class:`Amp`)."""
    device = torch.device(device)
    to_channels_last(model.to(device), device).eval()
    amp = Amp(device, precision)
    out = []
    for i in range(0, len(images), batch_size):
        with amp.autocast():
            logits = model(to_input(images[i : i + batch_size], device))
        out.append(F.softmax(logits.float(), dim=1).cpu())
    return torch.cat(out) if out else torch.empty(0)


def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    precision: str | None = None,
) -> dict[str, float]:
    """Loss and every metric of :func:`fedderm.metrics.classification_metrics` on one split, and
    the confusion matrix over all ``num_classes`` classes (flattened row-major, ``CONFUSION_KEY``)."""
    probs = predict(model, images, batch_size, device, precision)
    y = labels.numpy()
    loss = F.nll_loss(torch.log(probs.clamp_min(1e-12)), labels).item()
    cm = confusion(y, probs.numpy().argmax(axis=1), num_classes) if len(y) else np.zeros((num_classes,) * 2)
    return {
        "loss": loss,
        **classification_metrics(y, probs.numpy(), num_classes),
        "num-examples": int(len(y)),
        CONFUSION_KEY: [int(v) for v in cm.reshape(-1)],
    }
