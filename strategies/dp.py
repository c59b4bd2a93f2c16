"""Model-update privacy for the FedAvg family: central DP with server-side fixed clipping
(Andrew et al. 2021 / McMahan et al. 2018, arXiv:1710.06963), computed as Flower's
``DifferentialPrivacyServerSideFixedClipping`` computes it (its helper functions are not public
API: :func:`clip_update`, :func:`noise_std` and :func:`add_noise` write them out;
tests/test_model_dp.py checks the result against the wrapper's, bit for bit).

Every round, each accepted reply's update Δ_i = w_i − w_global is clipped to L2 norm C
(``dp.clip-norm``; :func:`clip_update`) over every floating-point array of the model, and the
released model is w_global + (1/n) Σ clip(Δ_i) + N(0, (σC/n)² I) (:func:`noise_std`,
:func:`add_noise`; σ = ``dp.noise-multiplier``), n = the clients sampled in the round (the train
messages sent), whatever number m ≤ n of them is aggregated.  The noise comes from a generator
seeded each round by the OS's CSPRNG (:func:`fedderm.noise.secure_generator`): no client can
regenerate it from the run config and subtract it.  Only ``insecure-reproducible-noise``
(simulation only) seeds it from ``seed`` and the round (:func:`noise_generator`).

Neighbouring relation: add/remove one client's update (present in the sum or absent: its data
deleted, or its reply failed or was rejected), n fixed.  The denominator is n, not m: this is
McMahan et al.'s fixed-denominator estimator (§2, f̃_f with sampling probability 1), whose
sensitivity is C/n under add/remove; the mean over the m replies (their f̃_c) moves by up to
2C/m when a client is removed, because m changes too.  With every sampled client aggregated
(m = n) both are the same number, and the computation is Flower's wrapper's (it takes n as
``num_sampled_clients``).  A replaced client (substitution) moves the sum by up to 2C.

Only floating-point arrays are clipped, averaged and noised (:func:`noised_keys`).  An integer
buffer (a counter) keeps the value the server sent: noise would round it into garbage, and the
clients' counters would tell how much data they have.  BatchNorm models are refused before the run
(``fedderm/methods/fedavg.py``: ``check_dp``), as Opacus refuses them (``ModuleValidator``, which
replaces BatchNorm by GroupNorm): the running statistics come from the clients' data, so they would
be noised too, and the noise on the weights leaves them describing activations the new weights no
longer produce; the evaluated model then diverges (NaN; docs/privacy.md, "BatchNorm").

Why a mixin rather than Flower's wrapper: the wrapper *contains* the strategy, so it hides
fedderm's hooks (``evaluate_round``, ``after_round``, ``state_dict``) from the round loop, skips the
round when any reply is an error (fedderm screens and drops failed clients), weights by
``num-examples`` unless its accountant is on, clips in the replies' dtype (float32) where this
clips in float64, and clips and noises every array, integer buffers included.  And its noise is
``np.random.normal``, NumPy's global generator, which fedderm's ServerApp seeds with ``seed``
(``fedderm.train.seed_everything``: data, init): inside fedderm every client could regenerate it.
Here the same computation runs inside fedderm's ``aggregate_train`` after screening, with the noise
of its own generator (docs/privacy.md, "Model-update privacy").

Accounting: every released model is one Gaussian mechanism with noise multiplier σ on the
client-level sensitivity C/n, every client in every round (sample rate 1, no amplification);
rounds compose in Opacus' RDP accountant (:func:`fedderm.relay_privacy.relay_epsilon`).
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common import log
from flwr.serverapp import Grid

from fedderm.config import ConfigError
from fedderm.flower_private import grid_kind
from fedderm.noise import REPRODUCIBLE, secure_generator
from fedderm.relay_privacy import relay_epsilon

#: the methods whose replies are one full model averaged by FedAvg: server-side clipping fits them
DP_METHODS = ("fedavg", "fedprox")


def noise_seed(seed: int, server_round: int) -> int:
    """The NumPy seed of round ``server_round``'s noise under ``insecure-reproducible-noise`` only
    (a function of ``seed`` and the round: anyone who knows the run config can regenerate it)."""
    return (int(seed) * 1_000_003 + int(server_round) * 7_919 + 17) % (2**32)


def noise_generator(cfg, server_round: int) -> np.random.Generator | np.random.RandomState:
    """The generator of round ``server_round``'s noise: seeded by the OS's CSPRNG; under
    ``insecure-reproducible-noise`` NumPy's legacy generator seeded by :func:`noise_seed` (the
    numbers Flower's wrapper draws after ``np.random.seed(noise_seed(...))``)."""
    if cfg.insecure_reproducible_noise:
        return np.random.RandomState(noise_seed(cfg.seed, server_round))
    return secure_generator()


def deployed(grid) -> bool:
    """Whether ``grid`` reaches real SuperNodes: Flower's deployment grid, or any Flower grid that
    is neither it nor the simulation's (fail closed: a grid of a later Flower counts as a
    deployment).  A test's grid that is no Flower ``Grid`` says what it stands for in
    ``fedderm_grid_kind`` (``fedderm.flower_private.grid_kind``)."""
    kind = getattr(grid, "kind", None) or grid_kind(grid)  # FastPollGrid knows its inner grid's kind
    if kind != "other":
        return kind == "deployment"
    inner = grid
    while getattr(inner, "inner", None) is not None:  # the wrappers of strategies/ (FastPollGrid, ...)
        inner = inner.inner
    return isinstance(inner, Grid)


def refuse_reproducible_noise(cfg, grid, what: str) -> None:
    """A deployment refuses ``insecure-reproducible-noise``: its noise would be known to every party
    that knows the run config (every hospital and the coordinating site)."""
    if cfg.insecure_reproducible_noise and deployed(grid):
        raise ConfigError(
            f"run-config key {REPRODUCIBLE!r} is true in a deployment: {what} would be a function of the "
            "run config, which every hospital and the server know, so anyone could subtract it and the "
            f"reported epsilon would not hold. Set {REPRODUCIBLE} = false (it is for simulations only; "
            "docs/privacy.md)"
        )


def l2_norm(arrays: list[np.ndarray]) -> float:
    """‖Δ‖₂ over every entry of ``arrays`` (the norm of each array, then of those norms)."""
    norms = [np.linalg.norm(a.flat) for a in arrays]
    return float(np.sqrt(sum([n**2 for n in norms])))


def clip_update(update: list[np.ndarray], current: list[np.ndarray], clip: float) -> float:
    """FlatClip (arXiv:1710.06963, Alg. 1): Δ = ``update`` − ``current`` scaled by min(1, C/‖Δ‖);
    ``update`` becomes ``current`` + the clipped Δ (in place).  Returns ‖Δ‖ before clipping."""
    delta = [np.subtract(u, c) for u, c in zip(update, current, strict=True)]
    norm = l2_norm(delta)
    scale = min(1, clip / norm)
    for d in delta:
        d *= scale
    for i, c in enumerate(current):
        update[i] = c + delta[i]
    return norm


def noise_std(sigma: float, clip: float, clients: int) -> float:
    """The Gaussian noise's standard deviation σC/n, n = ``clients`` sampled (arXiv:1710.06963)."""
    return float((sigma * clip) / clients)


def add_noise(arrays: list[np.ndarray], std: float, rng: np.random.Generator | np.random.RandomState) -> None:
    """Add N(0, std²) noise drawn from ``rng`` to every entry (in place), array after array (as
    Flower's ``add_gaussian_noise_inplace`` draws from NumPy's global generator)."""
    for a in arrays:
        a += rng.normal(0, std, a.shape).astype(a.dtype)


def noised_keys(record: ArrayRecord) -> list[str]:
    """The keys of ``record`` that are clipped, averaged and noised: every floating-point array.
    The rest (integer buffers) the released model takes from the global model sent."""
    return [k for k, a in record.items() if np.dtype(a.dtype).kind == "f"]


def _record(names, arrays) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(names, arrays, strict=True)})


class ServerSideFixedClipping:
    """Mixin in front of a :class:`strategies.common.Tracked` FedAvg-family strategy: clips every
    accepted update to ``dp.clip-norm``, sums the clipped updates with equal weights over the
    clients sampled and adds Gaussian noise (module docstring).  Records ``model_privacy`` (ε per
    round) in summary.json."""

    uniform_mean = True  # the sensitivity C/n needs equal weights (Flower's accountant demands them too)

    def _dp(self) -> tuple[float, float, float]:
        o = self.cfg.option
        return float(o("dp.clip-norm")), float(o("dp.noise-multiplier")), float(o("dp.delta"))

    def configure_train(self, server_round, arrays, config, grid):
        refuse_reproducible_noise(self.cfg, grid, "the Gaussian noise on every round's aggregate (dp.*)")
        return super().configure_train(server_round, arrays, config, grid)

    def _aggregate(self, server_round: int, replies: list):
        clip, sigma, delta = self._dp()
        names = list(self.sent.keys())
        sent = dict(zip(names, self.sent.to_numpy_ndarrays(), strict=True))
        private = noised_keys(self.sent)
        current = [np.asarray(sent[k], dtype=np.float64) for k in private]
        norms = []
        for msg in replies:
            record = msg.content["arrays"]
            update = [np.asarray(record[k].numpy(), dtype=np.float64) for k in private]
            norms.append(clip_update(update, current, clip))
            clipped = dict(zip(private, update, strict=True))
            msg.content["arrays"] = _record(names, [clipped.get(k, sent[k]) for k in names])
        arrays, metrics = super()._aggregate(server_round, replies)
        if arrays is None:
            return arrays, metrics
        m = len(replies)
        n = max(len(getattr(self, "_sent_to", None) or ()), m)  # the clients sampled this round
        std = noise_std(sigma, clip, n)
        released = [np.asarray(arrays[k].numpy(), dtype=np.float64) for k in private]
        if m < n:  # the fixed denominator: w + (1/n) Σ clip(Δ_i) = w + (m/n) (mean - w)
            released = [c + (r - c) * (m / n) for r, c in zip(released, current, strict=True)]
        if sigma > 0:
            add_noise(released, std, noise_generator(self.cfg, server_round))
            if self.cfg.insecure_reproducible_noise:
                log(
                    WARNING,
                    "dp round %d: %s = true: this round's noise is seeded from seed and round; anyone "
                    "who knows the run config can subtract it (the epsilon below does not hold)",
                    server_round,
                    REPRODUCIBLE,
                )
        out = dict(zip(private, released, strict=True))
        arrays = _record(names, [out.get(k, sent[k]) for k in names])
        self.dp_releases = getattr(self, "dp_releases", 0) + 1
        eps = relay_epsilon(sigma, self.dp_releases, delta)
        entry = {
            "round": int(server_round),
            "clip": clip,
            "noise_multiplier": sigma,
            "noise_std": std,
            "delta": delta,
            "clients": m,
            "sampled": n,
            "clipped": int(sum(norm > clip for norm in norms)),
            "update_norm_max": float(max(norms)),
            "releases": self.dp_releases,
            "epsilon": eps,
        }
        self.note("model_privacy", entry)
        if eps != float("inf"):
            self.note_scalars("privacy", server_round, {"model-epsilon": eps})
        log(
            INFO,
            "dp round %d: %d/%d updates clipped to %.4g (max norm %.4g), summed over %d sampled, noise std "
            "%.4g, (ε, δ) = (%.4g, %g)",
            server_round,
            entry["clipped"],
            m,
            clip,
            entry["update_norm_max"],
            n,
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
