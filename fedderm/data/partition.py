"""Partitions of a pool across clients, and each client's train/val/test and labelled splits.

IID and Dirichlet partitions come from flwr-datasets' partitioners (Dirichlet over labels as in
paper 003 §IV-B); ``source`` gives each client one site (paper 000 §V-A).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pool import DataError

PARTITIONS = ("iid", "dirichlet", "source")


def _label_table(labels: np.ndarray, order: np.ndarray | None = None):
    """A (pool index, label) table, rows in ``order`` (default: pool order)."""
    import datasets  # heavy import, needed only when a partition is computed

    labels = np.asarray(labels, dtype=np.int64)
    order = np.arange(len(labels)) if order is None else np.asarray(order, dtype=np.int64)
    return datasets.Dataset.from_dict({"idx": order, "label": labels[order]})


def iid_partition(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Shuffle, then cut into ``num_partitions`` near-equal shards (flwr-datasets IidPartitioner)."""
    from flwr_datasets.partitioner import IidPartitioner

    partitioner = IidPartitioner(num_partitions)
    partitioner.dataset = _label_table(labels).shuffle(seed=seed)
    return [np.sort(partitioner.load_partition(p)["idx"]) for p in range(num_partitions)]


def dirichlet_partition(
    labels: np.ndarray, num_partitions: int, alpha: float, seed: int, min_partition_size: int | None = None
) -> list[np.ndarray]:
    """Per class, split its samples across clients with proportions ~ Dir(alpha) (003 §IV-B).

    The pool is first put in a random order seeded by ``seed``, so each class's samples are dealt
    at random, not in file order; the same seed gives the same partition.

    Large alpha gives near-balanced label distributions, small alpha skewed ones.  Sampling is
    repeated until every client holds at least ``min_partition_size`` samples.
    """
    from flwr_datasets.partitioner import DirichletPartitioner

    if min_partition_size is None:
        min_partition_size = min(10, len(labels) // (2 * num_partitions))
    partitioner = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min_partition_size,
        self_balancing=False,
        seed=seed,
    )
    # DirichletPartitioner cuts each class's indices, in table order, into consecutive blocks:
    # hand it the pool in a seeded random order, so that no client gets a run of the file order
    # (which may track a site, a scanner or MedMNIST's train/val/test stacking), as 003's
    # reference code does with np.random.shuffle of each class's indices.
    partitioner.dataset = _label_table(labels, order=np.random.default_rng(seed).permutation(len(labels)))
    return [np.sort(partitioner.load_partition(p)["idx"]) for p in range(num_partitions)]


def source_partition(
    sites: np.ndarray | None, site_names: list[str], num_partitions: int
) -> list[np.ndarray]:
    """One site per client: client ``p`` gets every image of the ``p``-th site."""
    if sites is None:
        raise DataError(
            "partition='source' needs site information; this data set has none "
            "(use a site column, a site-per-folder layout, or partition='iid'/'dirichlet')"
        )
    if len(site_names) != num_partitions:
        raise DataError(
            f"partition='source' needs one client per site: the data has "
            f"{len(site_names)} sites {site_names} but the federation has "
            f"{num_partitions} clients"
        )
    return [np.flatnonzero(sites == s) for s in range(num_partitions)]


def partition_indices(
    scheme: str,
    labels: np.ndarray,
    num_partitions: int,
    *,
    seed: int,
    alpha: float = 0.5,
    sites: np.ndarray | None = None,
    site_names: list[str] | None = None,
) -> list[np.ndarray]:
    """Indices of each client's share of the pool; every index is used exactly once."""
    if scheme == "iid":
        return iid_partition(labels, num_partitions, seed)
    if scheme == "dirichlet":
        return dirichlet_partition(labels, num_partitions, alpha, seed)
    if scheme == "source":
        return source_partition(sites, site_names or [], num_partitions)
    raise DataError(f"unknown partition {scheme!r}; valid: {list(PARTITIONS)}")


@dataclass(frozen=True)
class ClientSplit:
    """Indices into the pool of one client's splits; ``labelled`` is a subset of ``train``."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    labelled: np.ndarray


def _stratified_cut(
    idx: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``idx`` into (rest, cut) with ~``fraction`` of every class in ``cut``."""
    cut = []
    for c in np.unique(labels[idx]):
        members = rng.permutation(idx[labels[idx] == c])
        n = int(round(fraction * len(members)))
        cut.append(members[:n])
    cut = np.sort(np.concatenate(cut)) if cut else np.array([], dtype=np.int64)
    return np.setdiff1d(idx, cut), cut


def _group_cut(
    idx: np.ndarray, groups: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``idx`` into (rest, cut) by whole groups (e.g. one lesion never on both sides)."""
    uniq = rng.permutation(np.unique(groups[idx]))
    counts = np.array([(groups[idx] == g).sum() for g in uniq])
    take = uniq[np.cumsum(counts) <= round(fraction * len(idx))]
    mask = np.isin(groups[idx], take)
    return idx[~mask], idx[mask]


def fold_groups(
    idx: np.ndarray,
    labels: np.ndarray,
    folds: int,
    rng: np.random.Generator,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Cut ``idx`` into ``folds`` near-equal groups, stratified by class (every class dealt
    round-robin after a shuffle); with ``groups``, whole groups are dealt instead."""
    out: list[list[np.ndarray]] = [[] for _ in range(folds)]
    if groups is not None:
        for i, g in enumerate(rng.permutation(np.unique(groups[idx]))):
            out[i % folds].append(idx[groups[idx] == g])
    else:
        offset = 0
        for c in np.unique(labels[idx]):
            members = rng.permutation(idx[labels[idx] == c])
            for i, m in enumerate(members):
                out[(i + offset) % folds].append(np.array([m]))
            offset += len(members)  # the next class starts where this one stopped: sizes stay even
    return [np.sort(np.concatenate(o)) if o else np.array([], dtype=np.int64) for o in out]


def split_client(
    idx: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    label_fraction: float = 1.0,
    groups: np.ndarray | None = None,
    cv_folds: int = 0,
    cv_fold: int = 0,
    fixed_val: np.ndarray | None = None,
) -> ClientSplit:
    """Stratified train/val/test split of one client's indices, then the labelled fraction.

    With ``groups`` (HAM10000 ``lesion_id``) whole groups go to one split so that images of
    one lesion never leak between train and test.  The labelled subset is a stratified
    ``label_fraction`` of train (at least one image per class present); the rest of train
    is the unlabelled pool for self-supervised methods.

    With ``cv_folds`` = k > 0 the fractions are ignored: the client's images are cut into k
    stratified groups (same cut for every ``cv_fold``, it depends on ``seed`` only); group
    ``cv_fold`` is test, group ``cv_fold + 1`` (mod k) is val, the rest is train.  Taking group f
    of every client forms the cross-centre fold of paper 004 §IV-B.

    With ``fixed_val`` (a data set's own validation images among ``idx``, e.g. MedMNIST's ``val_*``
    under ``test-set="global"``) val is those images and only test is cut from the rest.
    """
    rng = np.random.default_rng(seed)
    idx = np.sort(np.asarray(idx, dtype=np.int64))
    if cv_folds:
        parts = fold_groups(idx, labels, cv_folds, rng, groups)
        test, val = parts[cv_fold % cv_folds], parts[(cv_fold + 1) % cv_folds]
        train = np.setdiff1d(idx, np.concatenate([test, val]))
    elif fixed_val is not None:
        val = np.sort(np.asarray(fixed_val, dtype=np.int64))
        rest = np.setdiff1d(idx, val)
        cut = _group_cut if groups is not None else _stratified_cut
        train, test = cut(rest, groups if groups is not None else labels, test_fraction, rng)
    elif groups is not None:
        rest, test = _group_cut(idx, groups, test_fraction, rng)
        train, val = _group_cut(rest, groups, val_fraction / (1 - test_fraction), rng)
    else:
        rest, test = _stratified_cut(idx, labels, test_fraction, rng)
        train, val = _stratified_cut(rest, labels, val_fraction / (1 - test_fraction), rng)
    if label_fraction >= 1.0:
        labelled = train
    else:
        _, labelled = _stratified_cut(train, labels, label_fraction, rng)
        missing = np.setdiff1d(np.unique(labels[train]), labels[labelled])
        extra = [rng.choice(train[labels[train] == c]) for c in missing]
        labelled = np.sort(np.concatenate([labelled, np.asarray(extra, dtype=np.int64)]))
    return ClientSplit(train=train, val=val, test=test, labelled=labelled)
