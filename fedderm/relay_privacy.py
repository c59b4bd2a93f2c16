"""Private feature relay (FedCLF): clipping + Gaussian noise on every relayed feature
vector, and its privacy accounting with Opacus' RDP accountant.

Mechanism (per client, per upload): every feature vector f of the upload is clipped to L2 norm
``C`` (``fedclf.relay-clip``), f · min(1, C/‖f‖), and N(0, (σC)² I) noise is added
(σ = ``fedclf.relay-noise-multiplier``): the Gaussian mechanism with L2 sensitivity C per image
(adding or removing one image changes its own feature vector only), noise multiplier σ.

Accounting: an upload is the client's local bank Q_l, the newest K keys of a stream in which
every training image appears once per epoch, so one image is in one upload at most
``ceil((K - 1) / n) + 1`` times (n = training images; :func:`releases_per_upload`).  Every
release is one Gaussian mechanism without subsampling (sample rate 1); the releases of all uploads
so far (the initial one and one per round) compose in Rényi DP (Opacus ``RDPAccountant``),
converted to (ε, δ) at ``fedclf.relay-delta``.

Randomness: the noise comes from a generator seeded per upload by the OS's CSPRNG
(:func:`fedderm.noise.secure_generator`), so that nobody, the server included, can regenerate and
subtract it; only ``insecure-reproducible-noise`` seeds it from the run config.  The server shuffles
the relayed rows (de-identification, ``strategies/fedclf.py``) with such a generator too;
:func:`canonical_order` makes a client's training independent of that shuffle, so that a run
without noise keeps "same seed, same numbers".
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedderm.noise import secure_generator

__all__ = ["canonical_order", "privatise", "releases_per_upload", "relay_epsilon"]


def privatise(
    features: torch.Tensor, clip: float, noise_multiplier: float, insecure_seed: int | None = None
) -> torch.Tensor:
    """Rows clipped to L2 norm ``clip``, plus N(0, (noise_multiplier · clip)²) noise from the OS's
    CSPRNG (:func:`fedderm.noise.secure_generator`); with ``insecure_seed`` (only under
    ``insecure-reproducible-noise``) the noise is torch's seeded by it instead: anyone who knows the
    seed can subtract it."""
    x = features.detach().to(torch.float32).cpu()
    norms = x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    x = x * torch.clamp(clip / norms, max=1.0)
    if noise_multiplier > 0:
        if insecure_seed is None:
            noise = torch.from_numpy(secure_generator().standard_normal(tuple(x.shape), dtype=np.float32))
        else:
            noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(int(insecure_seed)))
        x = x + noise * (noise_multiplier * clip)
    return x


def canonical_order(features: np.ndarray) -> np.ndarray:
    """The rows of ``features`` sorted by their bytes: a function of the set of rows alone, so that
    what a client computes from the relayed features does not depend on the order the server's
    (secure, unrepeatable) shuffle put them in.  Rows with equal bytes are interchangeable."""
    if len(features) < 2:
        return features
    rows = np.ascontiguousarray(features)
    keys = rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel()
    return rows[np.argsort(keys, kind="stable")]


def releases_per_upload(queue_size: int, num_images: int) -> int:
    """The most times one image's feature can be in one upload of the newest ``queue_size`` keys."""
    if num_images <= 0:
        return 0
    return math.ceil((queue_size - 1) / num_images) + 1


def relay_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """ε of ``releases`` compositions of the Gaussian mechanism with ``noise_multiplier`` at ``delta``
    (Opacus ``RDPAccountant``, sample rate 1); ``inf`` without noise, 0 without releases."""
    if releases <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(noise_multiplier), 1.0, int(releases))]
    return float(accountant.get_epsilon(delta=float(delta)))
