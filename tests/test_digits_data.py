"""dataset="digits": scikit-learn's bundled digits as a MedMNIST-style npz (fedderm/data/digits.py)."""

import numpy as np
import pytest

import registry
from fedderm.data import load_pool
from fedderm.data.digits import main, write_digits_npz
from fedderm.data.npz import load_npz

pytest.importorskip("sklearn")


def test_digits_pool_is_the_bundled_digits_with_stratified_medmnist_splits(tmp_path):
    pool = load_pool("digits", "", image_size=16, seed=0, cache_dir=tmp_path)
    assert pool.images.shape == (1797, 3, 16, 16) and pool.classes == [str(d) for d in range(10)]
    assert np.bincount(pool.splits).tolist() == [1257, 180, 360]  # train, val, test
    test_counts = np.bincount(pool.labels[pool.splits == 2], minlength=10)
    assert test_counts.min() >= 35 and test_counts.max() <= 37  # stratified: ~20 % of each class
    assert pool.images.float().std() > 50  # real strokes, not a blank image
    # the file `python -m fedderm.data.digits` writes is the same data, read as dataset="npz"
    main([str(tmp_path / "d.npz")])
    again = load_npz(tmp_path / "d.npz", 16)
    assert np.array_equal(again.labels, pool.labels) and bool((again.images == pool.images).all())
    assert write_digits_npz(tmp_path / "e.npz").read_bytes() != b""


def test_digits_needs_no_data_path():
    assert registry.load_config({"dataset": "digits"}).dataset == "digits"
