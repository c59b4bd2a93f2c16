"""The global test set of ``test-set="global"`` (docs/test-sets.md).

Papers 002 and 003 report their metrics on *one* test set, not as a mean over the clients' own test
slices.  With ``test-set="global"`` a test set is fixed *before* the pool is partitioned, so no
client ever trains (or selects its best round) on it:

* ``test-data-path`` names a separate test set (same ``dataset`` format and class list); all its
  images are the test set, except a MedMNIST ``.npz``, whose ``test_*`` arrays are;
* otherwise a MedMNIST ``.npz`` keeps its official split: ``test_*`` is the global test set,
  ``val_*`` the clients' validation images and ``train_*`` their training (and own test) images;
* otherwise a stratified ``test-fraction`` of the pool (whole groups, e.g. HAM10000 lesions, when the
  data has them), drawn with ``seed``.

The final model is evaluated on it by the clients (the data never leaves them): each is sent the
model with ``split="global-test"`` and evaluates it on the whole global test set with its method's
own evaluation (so methods with one global model report the same numbers from every client, methods
with per-client models each client's own).  Nothing here imports Flower.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ConfigError
from .data.partition import _group_cut, _stratified_cut
from .data.pool import DataError, ImagePool

TEST_SETS = ("per-client", "global")
#: the split name a client's evaluation is asked for to evaluate the global test set
GLOBAL_SPLIT = "global-test"
#: salt of the seed that draws a stratified global test set (so it differs from a client's cuts)
_SALT = 7_919


@dataclass(frozen=True)
class GlobalSplit:
    """Indices into the pool: the global ``test`` set, the ``rest`` that is partitioned, and (with
    an official split) the ``official_val`` images among ``rest`` that are the clients' val sets."""

    test: np.ndarray
    rest: np.ndarray
    official_val: np.ndarray | None = None
    source: str = "stratified"  # "npz test_* arrays" | "stratified" | "test-data-path"


def check_test_data_path(cfg) -> None:
    """``test-data-path``, when set, must exist (raises naming the key and the file)."""
    if cfg.test_data_path and not Path(cfg.test_data_path).expanduser().exists():
        raise ConfigError(f"run-config key 'test-data-path': {cfg.test_data_path!r} does not exist "
                        f"(resolved: {Path(cfg.test_data_path).expanduser().resolve()})")


def npz_split_codes(path: str | Path, pool: ImagePool) -> np.ndarray | None:
    """Per pool image, 0/1/2 for the ``train``/``val``/``test`` array of the MedMNIST ``.npz`` it
    came from (the pool holds them in that order, minus skipped out-of-range labels); None when the
    file is no such archive or does not match ``pool``."""
    path = Path(path).expanduser()
    if path.suffix.lower() != ".npz" or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = [np.asarray(archive[f"{split}_labels"]) for split in ("train", "val", "test")]
    except (KeyError, ValueError, OSError):
        return None
    labels = [a[:, 0] if a.ndim == 2 else a.reshape(-1) for a in arrays]
    codes = np.concatenate([np.full(len(lab), i, dtype=np.int64) for i, lab in enumerate(labels)])
    all_labels = np.concatenate(labels).astype(np.int64)
    keep = (all_labels >= 0) & (all_labels < len(pool.classes))
    if int(keep.sum()) != len(pool) or not np.array_equal(all_labels[keep], pool.labels):
        raise DataError(f"{path}: its train/val/test arrays do not match the decoded pool "
                        f"({int(keep.sum())} usable labels, {len(pool)} images); clear the cache-dir")
    return codes[keep]


def global_split(pool: ImagePool, cfg, data_path: str) -> GlobalSplit:
    """The global test set held out of ``pool`` (the data at ``data_path``) before partitioning."""
    everything = np.arange(len(pool), dtype=np.int64)
    if cfg.test_data_path:  # a separate test set: the whole pool is partitioned
        return GlobalSplit(test=np.array([], dtype=np.int64), rest=everything, source="test-data-path")
    codes = npz_split_codes(data_path, pool) if cfg.dataset == "npz" else None
    if codes is not None and (codes == 2).any():
        return GlobalSplit(test=np.flatnonzero(codes == 2), rest=np.flatnonzero(codes != 2),
                           official_val=np.flatnonzero(codes == 1) if (codes == 1).any() else None,
                           source="npz test_* arrays")
    rng = np.random.default_rng(cfg.seed * 1_000_003 + _SALT)
    if pool.groups is not None:
        rest, test = _group_cut(everything, pool.groups, cfg.test_fraction, rng)
    else:
        rest, test = _stratified_cut(everything, pool.labels, cfg.test_fraction, rng)
    return GlobalSplit(test=np.sort(test), rest=np.sort(rest), source="stratified")


def test_pool(pool: ImagePool, cfg, load) -> tuple[ImagePool, np.ndarray]:
    """(pool, indices) of the global test images: from ``test-data-path`` (loaded with ``load``,
    ``load(path, classes)`` -> ImagePool, mapped onto the training pool's classes) or held out of
    ``pool``."""
    if not cfg.test_data_path:
        return pool, global_split(pool, cfg, cfg.data_path).test
    check_test_data_path(cfg)
    test = load(cfg.test_data_path, list(pool.classes))
    if list(test.classes) != list(pool.classes):
        raise DataError(f"run-config key 'test-data-path': {cfg.test_data_path} has classes {test.classes}, "
                        f"the training data {pool.classes}; set 'classes' to fix one order for both")
    codes = npz_split_codes(cfg.test_data_path, test) if cfg.dataset == "npz" else None
    idx = np.flatnonzero(codes == 2) if codes is not None and (codes == 2).any() else np.arange(len(test))
    if len(idx) == 0:
        raise DataError(f"run-config key 'test-data-path': {cfg.test_data_path} holds no test images")
    return test, idx
