"""Model-update privacy for the FedAvg family (issue 20): central DP with server-side fixed
clipping (Andrew et al. 2021 / McMahan et al. 2018, arXiv:1710.06963), with Flower's own DP
functions (``flwr.supercore.differential_privacy``, the ones its
``DifferentialPrivacyServerSideFixedClipping`` wrapper calls).

Every round, each accepted reply's update Δ_i = w_i − w_global is clipped to L2 norm C
(``dp.clip-norm``; Flower's ``compute_clip_model_update``), the clipped models are averaged with
equal weights (w_global + (1/m) Σ clip(Δ_i)), and Gaussian noise with standard deviation σC/m
(Flower's ``compute_stdv``, σ = ``dp.noise-multiplier``) is added to every entry of the aggregate
(Flower's ``add_gaussian_noise_inplace``, drawn from NumPy's global generator, which is seeded from
``seed`` and the round around the call and restored after).  m = the replies aggregated.

Why a mixin rather than Flower's wrapper: the wrapper *contains* the strategy, so it hides
fedderm's hooks (``evaluate_round``, ``after_round``, ``state_dict``) from the round loop, skips the
round when any reply is an error (fedderm screens and drops failed clients), and weights by
``num-examples`` unless its accountant is on.  Here the same functions run inside fedderm's
``aggregate_train`` after screening (docs/privacy.md, "Model-update privacy").

Accounting: every released aggregate is one Gaussian mechanism with noise multiplier σ on the
client-level sensitivity C/m, every client in every round (sample rate 1, no amplification);
rounds compose in Opacus' RDP accountant (:func:`fedderm.relay_privacy.relay_epsilon`).
"""

from __future__ import annotations

from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common import log
from flwr.supercore.differential_privacy import (
    add_gaussian_noise_inplace,
    compute_clip_model_update,
    compute_stdv,
    get_norm,
)

from fedderm.relay_privacy import relay_epsilon

#: the methods whose replies are one full model averaged by FedAvg: server-side clipping fits them
DP_METHODS = ("fedavg", "fedprox")


def noise_seed(seed: int, server_round: int) -> int:
    """The NumPy seed of round ``server_round``'s noise (a function of ``seed`` and the round only)."""
    return (int(seed) * 1_000_003 + int(server_round) * 7_919 + 17) % (2**32)


def _record(names, arrays) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(names, arrays, strict=True)})


class ServerSideFixedClipping:
    """Mixin in front of a :class:`strategies.common.Tracked` FedAvg-family strategy: clips every
    accepted update to ``dp.clip-norm``, averages with equal weights and adds Gaussian noise
    (module docstring).  Records ``model_privacy`` (ε per round) in summary.json."""

    uniform_mean = True  # the sensitivity C/m needs equal weights (Flower's accountant demands them too)

    def _dp(self) -> tuple[float, float, float]:
        o = self.cfg.option
        return float(o("dp.clip-norm")), float(o("dp.noise-multiplier")), float(o("dp.delta"))

    def _aggregate(self, server_round: int, replies: list):
        clip, sigma, delta = self._dp()
        names = list(self.sent.keys())
        current = [np.asarray(a, dtype=np.float64) for a in self.sent.to_numpy_ndarrays()]
        norms = []
        for msg in replies:
            record = msg.content["arrays"]
            update = [np.asarray(record[k].numpy(), dtype=np.float64) for k in names]
            norms.append(get_norm([u - c for u, c in zip(update, current, strict=True)]))
            compute_clip_model_update(param1=update, param2=current, clipping_norm=clip)
            msg.content["arrays"] = _record(names, update)
        arrays, metrics = super()._aggregate(server_round, replies)
        if arrays is None:
            return arrays, metrics
        m = len(replies)
        std = compute_stdv(sigma, clip, m)
        if sigma > 0:
            noisy = [np.asarray(arrays[k].numpy(), dtype=np.float64) for k in names]
            state = np.random.get_state()
            np.random.seed(noise_seed(self.cfg.seed, server_round))
            try:
                add_gaussian_noise_inplace(noisy, std)
            finally:
                np.random.set_state(state)
            arrays = _record(names, noisy)
        self.dp_releases = getattr(self, "dp_releases", 0) + 1
        eps = relay_epsilon(sigma, self.dp_releases, delta)
        entry = {
            "round": int(server_round),
            "clip": clip,
            "noise_multiplier": sigma,
            "noise_std": std,
            "delta": delta,
            "clients": m,
            "clipped": int(sum(n > clip for n in norms)),
            "update_norm_max": float(max(norms)),
            "releases": self.dp_releases,
            "epsilon": eps,
        }
        self.recorder.update_extra({"model_privacy": [*self.recorder.extra.get("model_privacy", []), entry]})
        if self.recorder.tracker is not None and eps != float("inf"):
            self.recorder.tracker.scalars("privacy", server_round, {"model-epsilon": eps})
        log(
            INFO,
            "dp round %d: %d/%d updates clipped to %.4g (max norm %.4g), noise std %.4g, (ε, δ) = (%.4g, %g)",
            server_round,
            entry["clipped"],
            m,
            clip,
            entry["update_norm_max"],
            std,
            eps,
            delta,
        )
        return arrays, metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dp_releases": getattr(self, "dp_releases", 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dp_releases = int(state.get("dp_releases", 0))
