import numpy as np
import pytest

import registry
from fedderm.data.partition import partition_indices, split_client
from fedderm.data.pool import DataError


def _labels(n=2000, classes=5, seed=0):
    return np.random.default_rng(seed).integers(0, classes, n)


def _class_shares(labels, parts, classes=5):
    return np.array([np.bincount(labels[p], minlength=classes) / len(p) for p in parts])


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_every_index_used_exactly_once(scheme):
    labels = _labels()
    parts = partition_indices(scheme, labels, 4, seed=1, alpha=0.5)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(labels)
    assert np.array_equal(np.sort(allidx), np.arange(len(labels)))


def test_dirichlet_is_reproducible_by_seed():
    labels = _labels()
    a = partition_indices("dirichlet", labels, 4, seed=3, alpha=0.5)
    b = partition_indices("dirichlet", labels, 4, seed=3, alpha=0.5)
    c = partition_indices("dirichlet", labels, 4, seed=4, alpha=0.5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_balanced_at_large_alpha_and_skewed_at_small_alpha():
    labels = _labels()
    global_share = np.bincount(labels) / len(labels)
    flat = _class_shares(labels, partition_indices("dirichlet", labels, 4, seed=0, alpha=100.0))
    skew = _class_shares(labels, partition_indices("dirichlet", labels, 4, seed=0, alpha=0.5))
    # total variation distance between each client's label mix and the global one
    tv_flat = 0.5 * np.abs(flat - global_share).sum(1)
    tv_skew = 0.5 * np.abs(skew - global_share).sum(1)
    assert tv_flat.max() < 0.08
    assert tv_skew.mean() > 0.25


def test_source_partition_one_site_per_client_and_mismatch_error():
    labels = _labels(30)
    sites = np.repeat([0, 1, 2], 10)
    parts = partition_indices("source", labels, 3, seed=0, sites=sites, site_names=["a", "b", "c"])
    assert [list(p) for p in parts] == [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    with pytest.raises(DataError, match="3 sites.*2 clients"):
        partition_indices("source", labels, 2, seed=0, sites=sites, site_names=["a", "b", "c"])
    with pytest.raises(DataError, match="site information"):
        partition_indices("source", labels, 2, seed=0, sites=None)


def test_split_is_stratified_disjoint_and_labelled_subset():
    labels = np.repeat(np.arange(5), 100)
    idx = np.arange(500)
    s = split_client(idx, labels, seed=0, label_fraction=0.1)
    assert len(s.train) == 300 and len(s.val) == 100 and len(s.test) == 100
    assert np.array_equal(np.sort(np.concatenate([s.train, s.val, s.test])), idx)
    for part in (s.val, s.test):
        assert np.array_equal(np.bincount(labels[part]), [20] * 5)
    assert set(s.labelled) <= set(s.train)
    assert np.array_equal(np.bincount(labels[s.labelled]), [6] * 5)


def test_split_keeps_groups_together():
    labels = np.repeat(np.arange(2), 60)
    groups = np.arange(120) // 3  # 40 lesions, 3 images each
    s = split_client(np.arange(120), labels, seed=0, groups=groups)
    sets = [set(groups[p]) for p in (s.train, s.val, s.test)]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert len(s.test) == pytest.approx(24, abs=3) and len(s.val) == pytest.approx(24, abs=3)


def test_label_fraction_keeps_every_class():
    labels = np.array([0] * 50 + [1] * 3)
    s = split_client(np.arange(53), labels, seed=0, label_fraction=0.1)
    assert set(labels[s.labelled]) == {0, 1}


def test_cv_folds_cut_each_client_into_stratified_groups():
    """004 §IV-B: k groups per centre; fold f tests on group f, validates on group f+1."""
    labels = np.repeat([0, 1, 2], [20, 17, 16])
    idx = np.arange(53)
    splits = [split_client(idx, labels, seed=4, cv_folds=5, cv_fold=f) for f in range(5)]
    tests = [s.test for s in splits]
    assert np.array_equal(np.sort(np.concatenate(tests)), idx)  # every image tested exactly once
    assert max(map(len, tests)) - min(map(len, tests)) <= 1
    for c in range(3):  # stratified: each class spread evenly over the groups
        counts = [np.sum(labels[t] == c) for t in tests]
        assert max(counts) - min(counts) <= 1
    for f, s in enumerate(splits):
        assert np.array_equal(s.val, tests[(f + 1) % 5])
        assert np.array_equal(np.sort(np.concatenate([s.train, s.val, s.test])), idx)
        assert not set(s.train) & (set(s.val) | set(s.test))
    with pytest.raises(Exception, match="cv-fold"):
        registry.load_config({"cv-folds": 5, "cv-fold": 5})
    with pytest.raises(Exception, match="cv-folds"):
        registry.load_config({"cv-folds": 2})


def _ordered_pool(n_per_class=200, classes=4):
    """A pool in 'file order': classes interleaved, and a hidden attribute (e.g. the sub-source
    an ISIC id range or a MedMNIST train/val/test stack tracks) that is 0 in the first half of
    the file and 1 in the second."""
    labels = np.tile(np.arange(classes), n_per_class)
    hidden = (np.arange(len(labels)) >= len(labels) // 2).astype(int)
    return labels, hidden


@pytest.mark.parametrize("alpha", [0.5, 100.0])
def test_dirichlet_deals_no_contiguous_run_of_any_class(alpha):
    """The partitioner gets each class's indices shuffled (by the seed), not
    in file order, so no client holds a consecutive block of a class's indices."""
    labels, _ = _ordered_pool()
    parts = partition_indices("dirichlet", labels, 4, seed=0, alpha=alpha)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)  # the class's indices in file order
        for part in parts:
            ranks = np.flatnonzero(np.isin(members, part))  # positions within the class
            if len(ranks) >= 5:
                assert ranks[-1] - ranks[0] + 1 > len(ranks), (c, ranks[:10])


def test_dirichlet_near_iid_at_alpha_100_also_in_the_hidden_attribute():
    labels, hidden = _ordered_pool()
    parts = partition_indices("dirichlet", labels, 4, seed=0, alpha=100.0)
    for part in parts:
        shares = np.bincount(labels[part], minlength=4) / len(part)
        np.testing.assert_allclose(shares, 0.25, atol=0.06)
        assert 0.38 < hidden[part].mean() < 0.62  # unshuffled: clients 0-1 would hold only 0s
    again = partition_indices("dirichlet", labels, 4, seed=0, alpha=100.0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
