"""Fréchet distance between image sets (the FID of Heusel et al. 2017) on offline features.

004 §III-A keeps the pseudo images "with small FID score" for the SSL stage.  FID fits a Gaussian
to the features of the real and of the generated images and takes the Fréchet (2-Wasserstein)
distance between the two Gaussians:

    d² = ‖μ_r − μ_g‖² + Tr(Σ_r + Σ_g − 2 (Σ_r Σ_g)^{1/2}).

The standard FID uses the pool features of an ImageNet Inception-v3.  No weights can be downloaded
here, so the default feature extractor is :class:`RandomFeatures`, a small CNN with weights drawn
from a fixed seed (the same network on every centre and in every run).  Distances on it are *not*
Inception-FID values and are not comparable with published FIDs; they do rank generators of one
centre against that centre's real images (random-network embeddings track image statistics,
Naeem et al. 2020).  A user can pass a TorchScript feature network instead
(:func:`load_feature_extractor`), e.g. an exported Inception, to get the standard score.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = [
    "gaussian_fit",
    "frechet_distance",
    "fid",
    "RandomFeatures",
    "load_feature_extractor",
    "image_features",
]

FEATURE_SEED = 20240  # fixed: the default features must not change with the run's seed


def gaussian_fit(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and covariance (D, D) of features (N, D), N − 1 in the denominator as in pytorch-fid."""
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or len(f) < 2:
        raise ValueError(f"need features of shape (N >= 2, D), got {f.shape}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric positive semi-definite matrix (negative round-off clipped)."""
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """d² = ‖μ1 − μ2‖² + Tr(Σ1) + Tr(Σ2) − 2 Tr((Σ1 Σ2)^{1/2}).

    Tr((Σ1 Σ2)^{1/2}) is computed as Tr((Σ1^{1/2} Σ2 Σ1^{1/2})^{1/2}) (same eigenvalues, but a
    symmetric PSD matrix, so no complex round-off and singular covariances are fine).
    """
    mu1, mu2 = np.atleast_1d(mu1).astype(np.float64), np.atleast_1d(mu2).astype(np.float64)
    sigma1, sigma2 = np.atleast_2d(sigma1).astype(np.float64), np.atleast_2d(sigma2).astype(np.float64)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (len(mu1), len(mu1)):
        raise ValueError(
            f"shapes differ: mu {mu1.shape} / {mu2.shape}, sigma {sigma1.shape} / {sigma2.shape}"
        )
    root1 = _psd_sqrt(sigma1)
    middle = root1 @ sigma2 @ root1
    cross = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(max(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * cross, 0.0))


def fid(real_features: np.ndarray, fake_features: np.ndarray) -> float:
    """Fréchet distance between Gaussian fits of two feature sets."""
    return frechet_distance(*gaussian_fit(real_features), *gaussian_fit(fake_features))


class RandomFeatures(nn.Module):
    """Four stride-2 3×3 convolutions with ReLU (3→16→32→64→64 channels), then per-channel mean and
    standard deviation over space: 128 features.  Weights from ``FEATURE_SEED``; no training."""

    def __init__(self, seed: int = FEATURE_SEED):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        chans = [3, 16, 32, 64, 64]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            conv = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
            with torch.no_grad():
                conv.weight.normal_(0, (2.0 / (cin * 9)) ** 0.5, generator=g)
                conv.bias.zero_()
            layers += [conv, nn.ReLU()]
        self.net = nn.Sequential(*layers).eval()
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: float images in [0, 255], (N, 3, S, S) -> (N, 128)."""
        h = self.net(x / 127.5 - 1.0)
        return torch.cat([h.mean(dim=(2, 3)), h.std(dim=(2, 3), unbiased=False)], dim=1)


def load_feature_extractor(path: str = "") -> nn.Module:
    """``""`` -> :class:`RandomFeatures`; else the TorchScript module at ``path`` (``torch.jit.load``),
    called on float images in [0, 255] of shape (N, 3, S, S) and returning (N, D) features."""
    if not path:
        return RandomFeatures()
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"run-config key 'ssl.fid-features': no file {str(file)!r} (a TorchScript "
            "feature network; leave it empty for the built-in random-CNN features)"
        )
    return torch.jit.load(str(file), map_location="cpu").eval()


@torch.no_grad()
def image_features(extractor: nn.Module, images: torch.Tensor, batch_size: int = 256) -> np.ndarray:
    """Features (N, D) of uint8 images (N, 3, S, S)."""
    out = []
    for i in range(0, len(images), batch_size):
        f = extractor(images[i : i + batch_size].float())
        if f.ndim != 2 or len(f) != len(images[i : i + batch_size]):
            raise ValueError(f"the FID feature network must return (N, D) features, got {tuple(f.shape)}")
        out.append(f.double().cpu().numpy())
    return np.concatenate(out)


def select_pseudo_images(
    generator: nn.Module,
    snapshots: list[tuple[int, dict]],
    real_images: torch.Tensor,
    n: int,
    *,
    keep: int = 1,
    extractor: nn.Module | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """004 §III-A's FID selection: rank the generator ``snapshots`` ((step, state dict), from
    :func:`fedderm.msggan.train_msggan`) by the FID of ``n`` generated images to the centre's
    ``real_images`` and return ``n`` images drawn evenly from the ``keep`` snapshots with the
    smallest FID, plus ``fid_step<k>`` for every snapshot and the chosen steps.

    Only generated images are returned; the real images never leave this function.
    """
    from .msggan import generate_images

    if not snapshots:
        raise ValueError("FID selection needs at least one generator snapshot")
    keep = min(keep, len(snapshots))
    extractor = extractor or RandomFeatures()
    real = image_features(extractor, real_images)
    scored: list[tuple[float, int, torch.Tensor]] = []
    info: dict[str, float] = {}
    for step, state in snapshots:
        generator.load_state_dict(state)
        generator.eval()
        images = generate_images(generator, n, seed=seed + step)
        value = fid(real, image_features(extractor, images))
        info[f"fid_step{step}"] = value
        scored.append((value, step, images))
        scored.sort(key=lambda t: (t[0], -t[1]))
        del scored[keep:]  # only the images of the best `keep` snapshots so far are kept
    for rank, (_, step, _) in enumerate(scored):
        info[f"fid_kept{rank}_step"] = step
    info["fid_selected"] = float(np.mean([value for value, _, _ in scored]))
    counts = [n // keep + (1 if i < n % keep else 0) for i in range(keep)]
    chosen = torch.cat([images[:c] for (_, _, images), c in zip(scored, counts)])
    return chosen, info
