"""dataset="digits" (fedderm/data/digits.py): scikit-learn's bundled digits as a pool, with sites, and as a
MedMNIST-style npz."""

import numpy as np
import pytest

pytest.importorskip("sklearn")

from fedderm.data.digits import CLASSES, load_digits_pool, write_digits_npz  # noqa: E402
from fedderm.data.npz import load_npz  # noqa: E402


def test_digits_pool_is_real_upscaled_and_sites_are_stratified():
    pool = load_digits_pool(16)
    assert tuple(pool.images.shape) == (1797, 3, 16, 16) and pool.classes == CLASSES
    assert np.bincount(pool.labels).tolist()[:3] == [178, 182, 177]
    assert pool.sites is None and int(pool.images.max()) == 255
    sited = load_digits_pool(16, sites=3, seed=1)
    counts = np.array([np.bincount(sited.labels[sited.sites == s], minlength=10) for s in range(3)])
    assert (counts.max(0) - counts.min(0) <= 1).all()  # each class dealt out evenly
    means = [sited.images[sited.sites == s].float().mean((0, 2, 3)) for s in range(3)]
    assert not np.allclose(means[0].numpy(), means[1].numpy(), atol=1.0)  # sites differ in colour
    again = load_digits_pool(16, sites=3, seed=1)
    assert (again.sites == sited.sites).all() and (again.images == sited.images).all()


def test_write_digits_npz_loads_with_its_splits(tmp_path):
    path = write_digits_npz(tmp_path / "digits.npz", image_size=28)
    pool = load_npz(path, 28)
    assert len(pool) == 1797 and pool.splits is not None
    assert np.bincount(pool.splits).tolist() == [1257, 180, 360]
