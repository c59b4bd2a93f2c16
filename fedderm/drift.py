"""Client-drift corrections of the optimisation baselines SiFT compares with (002 Table 1).

SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1, option II) and FedDyn (Acar et al., ICLR
2021, Algorithm 1).  Both act on the *trainable parameters* only: BatchNorm running statistics
and other buffers are not gradients' business and are averaged plainly by the server (the
published Flower SCAFFOLD baseline applies the variates to every state-dict entry, buffers
included, which is wrong for BatchNorm models).

Pure PyTorch; the per-client state (c_i, h_i) is passed in and returned as name -> tensor dicts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .train import train_supervised

Tensors = dict[str, torch.Tensor]


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter for every parameter that requires grad (state-dict names)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _get(d: Mapping[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """``d[name]`` on ``like``'s device, or zeros when the state is still empty (round 1)."""
    value = d.get(name)
    return torch.zeros_like(like) if value is None else value.to(like.device, like.dtype)


def scaffold_train(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    c_global: Mapping[str, torch.Tensor],
    c_local: Mapping[str, torch.Tensor],
    lr: float,
    **train_kwargs,
) -> tuple[dict[str, float], Tensors, Tensors]:
    """SCAFFOLD local training: every step uses the corrected gradient g(y) − c_i + c, then
    c_i⁺ = c_i − c + (x − y) / (K η_l)  (option II, K = local steps).

    Returns (metrics, c_i⁺, Δc = c_i⁺ − c_i).  Missing entries of ``c_global``/``c_local`` are zeros.
    """
    params = trainable(model)
    x = {n: p.detach().clone() for n, p in params.items()}
    correction = {n: _get(c_global, n, p) - _get(c_local, n, p) for n, p in params.items()}
    steps = 0

    def correct(m: nn.Module) -> None:
        nonlocal steps
        steps += 1
        for name, p in params.items():
            if p.grad is not None:
                p.grad.add_(correction[name])

    metrics = train_supervised(model, images, labels, lr=lr, after_backward=correct, **train_kwargs)
    new_local, delta = {}, {}
    with torch.no_grad():  # the same operations in the same order as the formula, in place: same bits
        for name, p in params.items():
            ci = _get(c_local, name, p)
            if steps == 0:
                new_local[name] = ci.clone()
                delta[name] = new_local[name] - ci
            else:
                moved = x[name].sub_(p.detach()).div_(steps * lr)  # (x − y) / (K η_l), in x's buffer
                # c_i − c into the correction's buffer (no longer needed), then + (x − y) / (K η_l)
                new_local[name] = torch.sub(ci, _get(c_global, name, p), out=correction[name]).add_(moved)
                delta[name] = torch.sub(new_local[name], ci, out=moved)  # Δc into x's buffer, done with
    metrics["local-steps"] = steps
    return metrics, {n: t.cpu() for n, t in new_local.items()}, {n: t.cpu() for n, t in delta.items()}


def scaffold_server_control(
    c_global: Mapping[str, torch.Tensor], deltas: list[Mapping[str, torch.Tensor]], num_clients: int
) -> Tensors:
    """c ← c + (1/N) Σ_i Δc_i over the clients that replied (N = all clients of the round)."""
    names = set(c_global).union(*[d.keys() for d in deltas]) if deltas else set(c_global)
    out = {}
    for name in sorted(names):
        # sum(...) in place: 0 + Δc_1 (a new tensor: the deltas may be read-only views), + Δc_2, ...
        parts = [d[name] for d in deltas if name in d]
        total = parts[0] + 0
        for part in parts[1:]:
            total.add_(part)
        total.div_(num_clients)
        base = c_global.get(name)
        # base + total (round 1: zeros + total, i.e. total + 0, which turns −0 into +0 as before)
        out[name] = total.add_(0) if base is None else torch.add(base, total, out=total)
    return out


def feddyn_train(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    h_local: Mapping[str, torch.Tensor],
    alpha: float,
    **train_kwargs,
) -> tuple[dict[str, float], Tensors]:
    """FedDyn local training: minimise L_k(θ) − ⟨h_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖², then
    h_k ← h_k − α (θ_k^t − θ^{t−1})  (h_k is the client's ∇L_k at its previous model).

    Returns (metrics, new h_k).  A missing ``h_local`` entry is zero (first round).
    """
    params = trainable(model)
    reference = {n: p.detach().clone() for n, p in params.items()}
    h = {n: _get(h_local, n, p) for n, p in params.items()}

    def regularizer(m: nn.Module) -> torch.Tensor:
        linear = sum((h[n] * p).sum() for n, p in params.items())
        quadratic = sum(((p - reference[n]) ** 2).sum() for n, p in params.items())
        return -linear + alpha / 2 * quadratic

    metrics = train_supervised(model, images, labels, regularizer=regularizer, **train_kwargs)
    with torch.no_grad():  # h_k − α (θ − θ^{t−1}), in the reference's buffer (no longer needed): same bits
        new_h = {
            n: torch.sub(
                h[n], torch.sub(p.detach(), reference[n], out=reference[n]).mul_(alpha), out=reference[n]
            ).cpu()
            for n, p in params.items()
        }
    return metrics, new_h


def feddyn_server_step(
    previous: Mapping[str, torch.Tensor],
    client_models: list[Mapping[str, torch.Tensor]],
    h: Mapping[str, torch.Tensor],
    alpha: float,
    num_clients: int,
    names: list[str],
) -> tuple[Tensors, Tensors]:
    """FedDyn server update for the parameters ``names``:
    h ← h − α (1/m) Σ_k (θ_k − θ^{t−1});  θ^t = (1/|P|) Σ_k θ_k − h/α.

    Returns (θ^t for ``names``, new h).  m = ``num_clients`` (all clients of the round).
    """
    new_h, theta = {}, {}
    for name in names:  # the same operations in the same order as the formulas, in place: same bits
        prev = previous[name]
        first, *rest = [m[name] for m in client_models]
        deltas = torch.sub(first, prev).add_(0)  # sum() starts from 0: 0 + (θ_1 − θ^{t−1})
        scratch = torch.empty_like(deltas)
        for m in rest:
            deltas.add_(torch.sub(m, prev, out=scratch))
        step = deltas.mul_(alpha).div_(num_clients)  # α Σ / m
        hn = h.get(name)
        hn = torch.zeros_like(step) if hn is None else hn
        new_h[name] = torch.sub(hn, step, out=step)
        mean = first + 0
        for m in rest:
            mean.add_(m)
        theta[name] = mean.div_(len(client_models)).sub_(torch.div(new_h[name], alpha, out=scratch))
    return theta, new_h
