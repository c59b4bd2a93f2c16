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
"""

from __future__ import annotations

import math

import torch

__all__ = ["privatise", "releases_per_upload", "relay_epsilon"]


def privatise(features: torch.Tensor, clip: float, noise_multiplier: float, seed: int) -> torch.Tensor:
    """Rows clipped to L2 norm ``clip``, plus N(0, (noise_multiplier · clip)²) noise (seeded)."""
    x = features.detach().to(torch.float32).cpu()
    norms = x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    x = x * torch.clamp(clip / norms, max=1.0)
    if noise_multiplier > 0:
        gen = torch.Generator().manual_seed(int(seed))
        x = x + torch.randn(x.shape, generator=gen) * (noise_multiplier * clip)
    return x


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
