"""The global test set of ``test-set="global"`` (docs/test-sets.md).

Papers 002 and 003 report their metrics on *one* test set, not as a mean over the clients' own test
slices.  With ``test-set="global"`` a test set is fixed *before* the pool is partitioned, so no
client ever trains (or selects its best round) on it:

* ``test-data-path`` names a separate test set (same ``dataset`` format and class list); all its
  images are the test set, except where it has its own split (below): then its test images are;
* otherwise the data's own split where it has one with test images (``pool.splits``): a MedMNIST
  ``.npz``'s ``test_*`` arrays, a CSV's ``split`` column, an image folder's ``test/`` folder are the
  global test set, the ``val`` images the clients' validation images and the ``train`` images their
  training (and own test) images;
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

from ..config import ConfigError
from .partition import _group_cut, _stratified_cut
from .pool import SPLIT_NAMES, DataError, ImagePool

TEST_SETS = ("per-client", "global")
#: the split name a client's evaluation is asked for to evaluate the global test set
GLOBAL_SPLIT = "global-test"
#: salt of the seed that draws a stratified global test set (so it differs from a client's cuts)
_SALT = 7_919
#: where the data's own split comes from, per dataset type (GlobalSplit.source)
_OWN_SPLIT = {"npz": "npz test_* arrays", "csv": "CSV split column", "folder": "test/ folder"}
_TEST, _VAL = SPLIT_NAMES.index("test"), SPLIT_NAMES.index("val")


@dataclass(frozen=True)
class GlobalSplit:
    """Indices into the pool: the global ``test`` set, the ``rest`` that is partitioned, and (with
    an official split) the ``official_val`` images among ``rest`` that are the clients' val sets."""

    test: np.ndarray
    rest: np.ndarray
    official_val: np.ndarray | None = None
    source: str = "stratified"  # "stratified" | "test-data-path" | one of _OWN_SPLIT's values


def check_test_data_path(cfg) -> None:
    """``test-data-path``, when set, must exist (raises naming the key and the file)."""
    if cfg.test_data_path and not Path(cfg.test_data_path).expanduser().exists():
        raise ConfigError(
            f"run-config key 'test-data-path': {cfg.test_data_path!r} does not exist "
            f"(resolved: {Path(cfg.test_data_path).expanduser().resolve()})"
        )


def global_split(pool: ImagePool, cfg) -> GlobalSplit:
    """The global test set held out of ``pool`` before partitioning: the data's own test split
    (``pool.splits``) where it has one, else a stratified ``test-fraction``."""
    everything = np.arange(len(pool), dtype=np.int64)
    if cfg.test_data_path:  # a separate test set: the whole pool is partitioned
        return GlobalSplit(test=np.array([], dtype=np.int64), rest=everything, source="test-data-path")
    codes = pool.splits
    if codes is not None and (codes == _TEST).any():
        return GlobalSplit(
            test=np.flatnonzero(codes == _TEST),
            rest=np.flatnonzero(codes != _TEST),
            official_val=np.flatnonzero(codes == _VAL) if (codes == _VAL).any() else None,
            source=_OWN_SPLIT.get(cfg.dataset, "own split"),
        )
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
        return pool, global_split(pool, cfg).test
    check_test_data_path(cfg)
    test = load(cfg.test_data_path, list(pool.classes))
    if list(test.classes) != list(pool.classes):
        raise DataError(
            f"run-config key 'test-data-path': {cfg.test_data_path} has classes {test.classes}, "
            f"the training data {pool.classes}; set 'classes' to fix one order for both"
        )
    codes = test.splits
    has_test = codes is not None and (codes == _TEST).any()
    idx = np.flatnonzero(codes == _TEST) if has_test else np.arange(len(test))
    if len(idx) == 0:
        raise DataError(f"run-config key 'test-data-path': {cfg.test_data_path} holds no test images")
    return test, idx
