"""FID (fedderm.fid): the Fréchet distance against scipy and by hand, and the selection of pseudo
images by FID (004 §III-A)."""

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from fedderm.fid import (
    RandomFeatures,
    fid,
    frechet_distance,
    gaussian_fit,
    image_features,
    select_pseudo_images,
)
from fedderm.msggan import snapshot_steps


def scipy_frechet(mu1, s1, mu2, s2):
    """The textbook formula with scipy's matrix square root (as pytorch-fid computes it)."""
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def test_frechet_distance_by_hand_in_one_dimension():
    # N(1, 2²) vs N(4, 3²): (1 - 4)² + (2 - 3)² = 10
    assert frechet_distance(
        np.array([1.0]), np.array([[4.0]]), np.array([4.0]), np.array([[9.0]])
    ) == pytest.approx(10)
    # diagonal covariances: sum over dimensions of (mu diff)² + (sd diff)²
    d = frechet_distance(np.zeros(2), np.diag([1.0, 4.0]), np.array([1.0, 0.0]), np.diag([9.0, 4.0]))
    assert d == pytest.approx(1 + (1 - 3) ** 2 + 0)


def test_fid_matches_scipy_on_correlated_features():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(200, 6)) @ rng.normal(size=(6, 6))
    b = rng.normal(loc=0.5, size=(150, 6)) @ rng.normal(size=(6, 6))
    mu1, s1 = gaussian_fit(a)
    mu2, s2 = gaussian_fit(b)
    assert np.allclose(s1, np.cov(a, rowvar=False)) and np.allclose(mu1, a.mean(0))
    assert fid(a, b) == pytest.approx(scipy_frechet(mu1, s1, mu2, s2), rel=1e-6)
    assert fid(a, a) == pytest.approx(0, abs=1e-6)
    # singular covariances (fewer samples than dimensions) stay finite and match scipy
    c, e = a[:4], b[:5]
    assert fid(c, e) == pytest.approx(scipy_frechet(*gaussian_fit(c), *gaussian_fit(e)), rel=1e-4)


def test_random_features_are_fixed_and_shaped():
    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    f1, f2 = image_features(RandomFeatures(), images), image_features(RandomFeatures(), images)
    assert f1.shape == (5, 128) and np.array_equal(f1, f2)  # same weights in every process and run


class ShiftGenerator(nn.Module):
    """A stand-in generator: images of brightness ``level`` (tanh space) plus latent noise."""

    latent_dim, scales = 3, [16]

    def __init__(self):
        super().__init__()
        self.level = nn.Parameter(torch.zeros(()))

    def forward(self, z):
        return [(self.level + 0.3 * z[:, :, None, None]).expand(-1, 3, 16, 16).clamp(-1, 1)]


def test_selection_keeps_the_snapshot_closest_to_the_real_images():
    g = torch.Generator().manual_seed(0)
    real = (0.2 + 0.3 * torch.randn(40, 3, 1, 1, generator=g)).expand(-1, 3, 16, 16).clamp(-1, 1) * 0.5 + 0.5
    real = (real * 255).round().to(torch.uint8)
    snapshots = [(step, {"level": torch.tensor(level)}) for step, level in [(1, -0.8), (2, 0.2), (3, 0.9)]]
    images, info = select_pseudo_images(ShiftGenerator(), snapshots, real, 10, keep=1, seed=0)
    assert info["fid_step2"] < info["fid_step1"] and info["fid_step2"] < info["fid_step3"]
    assert info["fid_kept0_step"] == 2 and images.shape == (10, 3, 16, 16) and images.dtype == torch.uint8
    gen = ShiftGenerator()
    gen.level.data.fill_(0.2)
    from fedderm.msggan import generate_images

    assert torch.equal(images, generate_images(gen, 10, seed=2))  # the images of snapshot 2
    both, info2 = select_pseudo_images(ShiftGenerator(), snapshots, real, 11, keep=2, seed=0)
    second = min((1, 3), key=lambda k: info2[f"fid_step{k}"])
    assert len(both) == 11 and (info2["fid_kept0_step"], info2["fid_kept1_step"]) == (2, second)
    assert torch.equal(
        both[:6], generate_images(gen, 11, seed=2)[:6]
    )  # 6 of snapshot 2, then 5 of the runner-up


def test_snapshot_steps_are_evenly_spaced():
    assert snapshot_steps(300, 4) == [75, 150, 225, 300] and snapshot_steps(3, 5) == [1, 2, 3]
