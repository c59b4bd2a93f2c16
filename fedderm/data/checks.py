"""Data checks that run once, before any training round: wrong data must stop the run
with one line naming the client, the file or folder, and the numbers, never look like success.

- fewer than 2 classes;
- an empty class (a class folder without images, a class in ``classes`` that no image has);
- with ``classes`` empty, a class with very few images (a typo'd label such as ``melanomaa``
  becomes a class of its own): stop and ask for ``classes``;
- a client with too few images for its train/val/test split.

Pure numpy; no Flower.  ``sim.py`` runs :func:`check_federation` before the simulation starts
(the data is local there); in a deployment each client runs :func:`check_pool` and
:func:`check_split` on its own data when it loads it (the server's handshake), and the server runs
:func:`check_union` on the class counts every client reports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedderm.config import EMBEDDED_DATASETS

from .partition import ClientSplit
from .pool import DataError, ImagePool

__all__ = ["RARE_MIN", "RARE_SHARE", "check_pool", "check_split", "check_union", "class_counts"]

log = logging.getLogger("fedderm.data")

#: With ``classes`` empty, a class is suspiciously rare when it has fewer than ``RARE_MIN``
#: images, or fewer than ``RARE_SHARE`` times the largest class (HAM10000's and ISIC 2019's
#: rarest classes hold 1.7 % and 1.9 % of their largest), and at most a fifth of the largest.
RARE_MIN, RARE_SHARE = 3, 0.005
#: Classes that may be empty by design: ISIC 2019's ``UNK`` column has no training image.
EMPTY_BY_DESIGN = frozenset({"unk"})


def class_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes)


def _where(dataset: str, data_path: str, cls: str) -> str:
    """The folder of class ``cls`` (``folder`` data), else the data file."""
    if dataset in EMBEDDED_DATASETS or not data_path:
        return f"the {dataset or 'synthetic'} data"
    root = Path(data_path).expanduser()
    if dataset == "folder" and root.is_dir():
        found = [p for p in (root / cls, *root.glob(f"*/{cls}")) if p.is_dir()]
        if found:
            return ", ".join(str(p) for p in found[:3])
    return str(root)


def _classes_fixed_by_file(dataset: str, data_path: str) -> bool:
    """An ISIC-style CSV lists its classes as one-hot columns: a rare column is no typo."""
    if dataset != "csv":
        return False
    try:
        with open(Path(data_path).expanduser(), encoding="utf-8-sig") as f:
            header = [c.strip() for c in f.readline().split(",")]
    except OSError:
        return False
    return "image" in header and "dx" not in header


def check_pool(
    pool: ImagePool, *, dataset: str, data_path: str, classes_given: bool, whole: bool = True, who: str = ""
) -> list[str]:
    """Check a pool's classes; raise :class:`DataError` (one line) on the first problem, return
    warnings.

    ``whole``: the pool is all the federation's data (simulation); a hospital's own data
    (``whole=False``) may lack a class that ``classes`` lists, which :func:`check_union` checks
    across clients instead.  ``who`` prefixes the messages (e.g. ``"client 2: "``).
    """
    classes = list(pool.classes)
    counts = class_counts(pool.labels, len(classes))
    src = f"the {dataset} data" if dataset in EMBEDDED_DATASETS else str(data_path)
    if len(classes) < 2:
        only = f" ({classes[0]!r}, {int(counts[0])} images)" if classes else ""
        raise DataError(
            f"{who}{src} has {len(classes)} class{only}: a classifier needs at least 2 "
            "(one class folder or label per class)"
        )
    warnings = []
    for cls, n in zip(classes, counts):
        if n:
            continue
        if cls.strip().lower() in EMPTY_BY_DESIGN:
            warnings.append(
                f"{who}class {cls!r} has no images in {src} (as in ISIC 2019's training set); "
                "the model keeps an output for it"
            )
        elif whole or not classes_given:
            fix = (
                "remove the class from the run-config key 'classes'"
                if classes_given
                else "remove the empty folder or add its images"
            )
            raise DataError(
                f"{who}class {cls!r} has 0 images ({_where(dataset, data_path, cls)}; "
                f"{len(pool)} images in {len(classes)} classes): {fix}"
            )
    if (
        not classes_given
        and dataset not in EMBEDDED_DATASETS
        and not _classes_fixed_by_file(dataset, data_path)
    ):
        largest = int(counts.max())
        limit = max(RARE_MIN, RARE_SHARE * largest)
        rare = [(c, int(n)) for c, n in zip(classes, counts) if 0 < n < limit and 5 * n <= largest]
        if rare:
            cls, n = min(rare, key=lambda cn: cn[1])
            raise DataError(
                f"{who}class {cls!r} has only {n} image{'s' * (n != 1)} "
                f"({_where(dataset, data_path, cls)}) while the largest has {largest}: "
                "a typo in a label or folder name? Fix it, or if it is a real class, list "
                "every class in the run-config key 'classes' (e.g. classes=\""
                + ",".join(c for c, k in zip(classes, counts) if k >= limit)
                + '")'
            )
    for w in warnings:
        log.warning("%s", w)
    return warnings


def check_split(
    split: ClientSplit,
    *,
    who: str,
    num_images: int,
    val_fraction: float,
    test_fraction: float,
    cv_folds: int = 0,
    needs_test: bool = True,
    source: str = "",
) -> None:
    """A client needs at least one image in train, in val and (``needs_test``) in test."""
    sizes = {"train": len(split.train), "val": len(split.val), "test": len(split.test)}
    wanted = ["train", "val"] + (["test"] if needs_test else [])
    if cv_folds == 0 and val_fraction <= 0:
        wanted.remove("val")
    if cv_folds == 0 and test_fraction <= 0 and "test" in wanted:
        wanted.remove("test")
    empty = [k for k in wanted if sizes[k] == 0]
    if not empty:
        return
    how = (
        f"cv-folds={cv_folds}"
        if cv_folds
        else f"val-fraction={val_fraction:g}, test-fraction={test_fraction:g}"
    )
    raise DataError(
        f"{who} has only {num_images} image{'s' * (num_images != 1)}{f' ({source})' if source else ''}, "
        f"too few for its train/val/test split: train {sizes['train']} · val {sizes['val']} · "
        f"test {sizes['test']} with {how}; use fewer clients, more images or other fractions"
    )


def check_union(counts: Mapping[str, Sequence[int]], classes: Sequence[str]) -> None:
    """Deployment: every class must have images at some client (``counts``: client -> per class)."""
    total = np.zeros(len(classes), dtype=np.int64)
    for c in counts.values():
        total += np.asarray(c, dtype=np.int64)
    empty = [cls for cls, n in zip(classes, total) if n == 0 and cls.strip().lower() not in EMPTY_BY_DESIGN]
    if empty:
        raise DataError(
            f"class {empty[0]!r} has 0 images at every client ({', '.join(sorted(counts))}; "
            f"{int(total.sum())} images in {len(classes)} classes): remove it from the run-config "
            "key 'classes'"
        )
