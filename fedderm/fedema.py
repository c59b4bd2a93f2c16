"""FedEMA (Zhuang, Wen & Zhang, ICLR 2022, "Divergence-aware federated self-supervised learning"
§5): BYOL clients whose local online network is updated from the global one by a
divergence-aware exponential moving average at the start of each round.

With W_g^r the global online network a client receives in round r and W_k^{r−1} its own online
network after its previous round (kept on the client):

- μ = min(λ · ‖W_g^r − W_k^{r−1}‖, 1), the divergence measured on the online encoder (backbone +
  projector; FedEMA's "online encoder" holds the projector) as one L2 norm over all its parameters;
- W_k^r ← μ · W_k^{r−1} + (1 − μ) · W_g^r for the online encoder, and the same EMA with the same μ
  for the predictor (the paper applies EMA to the predictor too; in the authors' code
  (EasyFL ``applications/fedssl``, ``--update_predictor dynamic_dapu``) both branches reduce to this);
- λ, the autoscaler: λ_k = τ / ‖W_g^{r+1} − W_k^r‖, computed once per client, at the first round
  in which it has a local model (its second participation), so that μ = τ then (paper: τ = 0.7).

The EMA covers the parameters; BatchNorm running statistics come from the global model. In the
client's first participation it has no local model: online = W_g, target ← online.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

#: the FedEMA paper's autoscaler target τ (§5, "τ = 0.7"; the authors' README runs FedEMA with 0.7)
TAU_AUTO = 0.7
#: the keys the divergence is measured on: the online encoder (backbone + projector)
ENCODER_PREFIXES = ("backbone.", "projector.")


def divergence(
    global_state: Mapping[str, torch.Tensor], local_state: Mapping[str, torch.Tensor], keys: Iterable[str]
) -> float:
    """‖W_g − W_k‖₂ over the tensors ``keys`` (flattened into one vector)."""
    total = 0.0
    for k in keys:
        total += float(((global_state[k].double() - local_state[k].double()) ** 2).sum())
    return math.sqrt(total)


def autoscaler(tau: float, distance: float) -> float:
    """λ = τ / ‖W_g − W_k‖ (FedEMA §5), so that the first divergence-aware update has μ = τ."""
    if distance <= 0:
        raise ValueError(f"the autoscaler needs a positive divergence, got {distance!r}")
    return tau / distance


def ema_weight(lam: float, distance: float) -> float:
    """μ = min(λ · ‖W_g − W_k‖, 1) (FedEMA §5)."""
    return min(lam * distance, 1.0)


def ema_update(
    local_state: Mapping[str, torch.Tensor],
    global_state: Mapping[str, torch.Tensor],
    mu: float,
    keys: Iterable[str],
) -> dict[str, torch.Tensor]:
    """``global_state`` with each tensor of ``keys`` replaced by μ · W_local + (1 − μ) · W_global."""
    out = {k: v.clone() for k, v in global_state.items()}
    for k in keys:
        out[k] = (mu * local_state[k].double() + (1 - mu) * global_state[k].double()).to(
            global_state[k].dtype
        )
    return out


def divergence_aware_update(
    local_state: Mapping[str, torch.Tensor],
    global_state: Mapping[str, torch.Tensor],
    param_keys: Iterable[str],
    encoder_keys: Iterable[str],
    lam: float | None,
    tau: float = TAU_AUTO,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One FedEMA update of a client's model: the divergence d on ``encoder_keys``, λ (``lam``, or
    when None the autoscaler's τ/d; 0 while d = 0), μ = min(λd, 1), and μ·W_k + (1 − μ)·W_g on
    ``param_keys`` (the other entries from ``global_state``).  Returns the new state and
    ``{"mu", "divergence", "lambda"}``."""
    distance = divergence(global_state, local_state, list(encoder_keys))
    if lam is None:
        lam = autoscaler(tau, distance) if distance > 0 else 0.0
    mu = ema_weight(lam, distance)
    return ema_update(local_state, global_state, mu, list(param_keys)), {
        "mu": mu,
        "divergence": distance,
        "lambda": lam,
    }
