"""Data: sources (synthetic, digits, stained-digits, folder, csv, npz), partitions across clients, per-client splits.

A client loads its share once per process with :func:`load_client_data`; the decoded pool is
cached on disk (``cache-dir``) and in memory, so epochs read tensors, never files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedderm.config import EMBEDDED_DATASETS

from . import testset
from .checks import check_pool, check_split
from .digits import load_digits_pool
from .partition import ClientSplit, partition_indices, split_client
from .pool import DataError, ImagePool
from .sources import load_source
from .stained import load_stained_digits_pool
from .synthetic import load_synthetic

__all__ = [
    "ClientData",
    "DataError",
    "ImagePool",
    "TensorBatches",
    "check_federation",
    "load_client_data",
    "load_pool",
]

log = logging.getLogger("fedderm.data")

_POOLS: dict[tuple, ImagePool] = {}
#: Every client's partition of a memoised pool, computed once per process: a simulation worker
#: serving 100 clients would otherwise cut the whole pool 100 times (O(clients²)).
_PARTITIONS: dict[tuple, list[np.ndarray]] = {}


def load_pool(
    dataset: str,
    data_path: str,
    *,
    image_size: int,
    seed: int,
    num_partitions: int = 1,
    synthetic_sites: int = 0,
    synthetic_per_class: int = 40,
    cache_dir: str | Path | None = None,
    classes: list[str] | None = None,
    image_dir: str = "",
    site_column: str = "auto",
    skip_bad_files: bool = False,
) -> ImagePool:
    """The decoded pool of a data source, memoised per process."""
    key = (
        dataset,
        data_path,
        image_size,
        seed,
        num_partitions,
        synthetic_sites,
        synthetic_per_class,
        str(cache_dir),
        tuple(classes or ()),
        image_dir,
        site_column,
        skip_bad_files,
    )
    if key not in _POOLS:
        if dataset == "synthetic":
            _POOLS[key] = load_synthetic(
                synthetic_sites or num_partitions, synthetic_per_class, image_size, seed, cache_dir
            )
        elif dataset == "digits":
            _POOLS[key] = load_digits_pool(image_size, sites=synthetic_sites or num_partitions, seed=seed)
        elif dataset == "stained-digits":
            _POOLS[key] = load_stained_digits_pool(
                image_size, sites=synthetic_sites or num_partitions, seed=seed
            )
        else:
            extra = {"image_dir": image_dir or None, "site_column": site_column} if dataset == "csv" else {}
            _POOLS[key] = load_source(
                dataset,
                data_path,
                image_size=image_size,
                classes=classes,
                skip_bad_files=skip_bad_files,
                cache_dir=cache_dir,
                **extra,
            )
    return _POOLS[key]


@dataclass
class ClientData:
    """One client's view of the pool: its train/val/test/labelled index sets."""

    pool: ImagePool
    split: ClientSplit
    partition_id: int
    #: ``test-set="global"``: () -> (pool, indices) of the global test set (fedderm.data.testset), loaded
    #: on first use; it is evaluated only, never trained on
    global_test: Callable[[], tuple[ImagePool, np.ndarray]] | None = None

    @property
    def classes(self) -> list[str]:
        return self.pool.classes

    @property
    def num_classes(self) -> int:
        return len(self.pool.classes)

    def tensors(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 images N×3×S×S, int64 labels N) of split ``train``|``val``|``test``|``labelled``, or
        ``global-test`` (the global test set of ``test-set="global"``)."""
        if which == testset.GLOBAL_SPLIT:
            if self.global_test is None:
                raise DataError(
                    f"client {self.partition_id} was asked for the global test set, but the "
                    "run has test-set='per-client'"
                )
            pool, idx = self.global_test()
            return pool.images[torch.from_numpy(idx)], torch.from_numpy(pool.labels[idx])
        idx = getattr(self.split, which)
        return self.pool.images[idx], torch.from_numpy(self.pool.labels[idx])

    def class_counts(self) -> dict[str, list[int]]:
        """Images per class (in ``classes`` order) of every split of this client."""
        return {
            which: np.bincount(
                self.pool.labels[getattr(self.split, which)], minlength=self.num_classes
            ).tolist()
            for which in ("train", "labelled", "val", "test")
        }

    def __repr__(self) -> str:
        s = self.split
        return (
            f"ClientData(partition={self.partition_id}, train={len(s.train)}, "
            f"labelled={len(s.labelled)}, val={len(s.val)}, test={len(s.test)})"
        )


def load_client_data(
    cfg, partition_id: int, num_partitions: int, *, data_path: str | None = None, dataset: str | None = None
) -> ClientData:
    """Load client ``partition_id``'s data according to the run config ``cfg``.

    In simulation every client partitions one shared pool (``cfg.partition``).  In deployment a
    hospital passes its own ``data_path`` (node config): all of it is that client's, nothing is
    partitioned.
    """
    own = data_path is not None
    path = data_path if own else cfg.data_path
    pool = load_pool(
        dataset or cfg.dataset,
        path,
        image_size=cfg.image_size,
        seed=cfg.seed,
        num_partitions=1 if own else num_partitions,
        synthetic_sites=cfg.synthetic_sites,
        synthetic_per_class=cfg.synthetic_per_class,
        cache_dir=cfg.cache_path,
        classes=cfg.class_list,
        image_dir=cfg.image_dir,
        site_column=cfg.site_column,
        skip_bad_files=cfg.skip_bad_files,
    )
    source = data_path if own else cfg.data_path
    kind = dataset or cfg.dataset
    check_pool(
        pool,
        dataset=kind,
        data_path=source,
        classes_given=bool(cfg.class_list) or kind in EMBEDDED_DATASETS,
        whole=not own,
        who=f"client {partition_id}: " if own else "",
    )
    test_set = getattr(cfg, "test_set", "per-client")
    held = None
    if test_set == "global":
        if own and not cfg.test_data_path:
            raise DataError(
                "test-set='global' with a hospital's own data (node-config data-path) needs the "
                "run-config key 'test-data-path': a test set every client can read"
            )
        held = testset.global_split(pool, cfg) if not own else None
    if own:
        idx = np.arange(len(pool))
    else:
        rest = held.rest if held is not None else np.arange(len(pool))
        key = (
            id(pool),
            cfg.partition,
            num_partitions,
            cfg.seed,
            cfg.dirichlet_alpha,  # pools live on in _POOLS
            test_set,
            cfg.test_fraction if held is not None else None,
            getattr(cfg, "test_data_path", ""),
        )
        if key not in _PARTITIONS:
            if cfg.partition != "source" and num_partitions > len(rest):
                where = f"the {kind} data" if kind in EMBEDDED_DATASETS else str(source)
                raise DataError(
                    f"client {len(rest)} has no images: {num_partitions} clients cannot share the "
                    f"{len(rest)} images of {where} (partition={cfg.partition!r}); use fewer clients "
                    "(--num-supernodes, min-clients) or more images"
                )
            parts = partition_indices(
                cfg.partition,
                pool.labels[rest],
                num_partitions,
                seed=cfg.seed,
                alpha=cfg.dirichlet_alpha,
                sites=None if pool.sites is None else pool.sites[rest],
                site_names=pool.site_names,
            )
            _PARTITIONS[key] = [rest[p] for p in parts]
        parts = _PARTITIONS[key]
        idx = parts[partition_id]
    if len(idx) == 0:
        raise DataError(
            f"client {partition_id} has an empty partition "
            f"(partition={cfg.partition!r}, {len(pool)} images in the pool)"
        )
    fixed_val = None
    if held is not None and held.official_val is not None and not cfg.cv_folds:
        fixed_val = np.intersect1d(idx, held.official_val)  # MedMNIST's val_*: this client's share
    split = split_client(
        idx,
        pool.labels,
        seed=cfg.seed * 1000 + partition_id,
        val_fraction=cfg.val_fraction,
        test_fraction=cfg.test_fraction,
        label_fraction=cfg.label_fraction,
        groups=pool.groups,
        cv_folds=cfg.cv_folds,
        cv_fold=cfg.cv_fold,
        fixed_val=fixed_val,
    )
    share = ("its own data " if own else f"partition={cfg.partition!r} of {len(pool)} images in ") + (
        f"the {kind} data" if kind in EMBEDDED_DATASETS else str(source)
    )
    check_split(
        split,
        who=f"client {partition_id}",
        num_images=len(idx),
        val_fraction=cfg.val_fraction,
        test_fraction=cfg.test_fraction,
        cv_folds=cfg.cv_folds,
        source=share,
        needs_test=test_set != "global",
    )
    loader = None
    if test_set == "global":

        def load_test(test_path: str, classes: list[str]) -> ImagePool:
            return load_pool(
                cfg.dataset,
                test_path,
                image_size=cfg.image_size,
                seed=cfg.seed,
                cache_dir=cfg.cache_path,
                classes=classes,
                image_dir=cfg.image_dir,
                site_column=cfg.site_column,
                skip_bad_files=cfg.skip_bad_files,
            )

        def loader(pool=pool, held=held):
            if held is not None and not cfg.test_data_path:
                return pool, held.test
            return testset.test_pool(pool, cfg, load_test)

    data = ClientData(pool=pool, split=split, partition_id=partition_id, global_test=loader)
    log.info("%r", data)
    return data


def check_federation(cfg, num_partitions: int) -> list[ClientData]:
    """Load every client's share of a simulation's pool once, running the data checks
    (:mod:`fedderm.data.checks`) on the pool and on each client's split; raise :class:`DataError`
    (one line naming the client, the file or folder, and the numbers) on the first problem.

    The decoded pool stays cached on disk (``cache-dir``) for the clients; the in-process copies
    are dropped, so that the driver of a simulation does not hold a second copy of the images.
    """
    try:
        return [load_client_data(cfg, p, num_partitions) for p in range(num_partitions)]
    finally:
        _POOLS.clear()
        _PARTITIONS.clear()


#: the share of a GPU's free memory a client's decoded uint8 images may take to be kept there
DEVICE_DATA_SHARE = 0.25


def fits_on_device(images: torch.Tensor, device: torch.device | str) -> bool:
    """Whether ``images`` may be copied to CUDA ``device`` whole: at most :data:`DEVICE_DATA_SHARE`
    of its free memory (``torch.cuda.mem_get_info``), so the model's activations keep the rest."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    free, _total = torch.cuda.mem_get_info(device)
    return images.numel() * images.element_size() <= DEVICE_DATA_SHARE * free


class TensorBatches:
    """Mini-batches of in-memory tensors; shuffled by a seeded generator (no worker processes).

    With a CUDA ``device`` the images arrive there: copied once per iteration
    object when they fit (:func:`fits_on_device`) and the batches cut on the GPU, else each batch
    from pinned memory with a non-blocking copy.  Labels stay on the CPU as given.  The shuffle is
    drawn on the CPU generator either way, so the batches hold the same images on every device;
    without a CUDA device nothing moves (the CPU path is unchanged).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        device: torch.device | str | None = None,
    ):
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.generator = torch.Generator().manual_seed(seed)
        self.device = torch.device(device) if device is not None else None
        self.pinned = False  # True: the images did not fit, batches go through pinned memory
        if self.device is not None and self.device.type == "cuda" and images.device != self.device:
            if fits_on_device(images, self.device):
                self.images = images.to(self.device, non_blocking=True)
            else:
                self.pinned = True

    def __len__(self) -> int:
        n = len(self.labels)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        n = len(self.labels)
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        on_device = order.to(self.images.device)
        for b in range(len(self)):
            sel = order[b * self.batch_size : (b + 1) * self.batch_size]
            if self.pinned:
                xb = self.images[sel].pin_memory().to(self.device, non_blocking=True)
            else:
                xb = self.images[on_device[b * self.batch_size : (b + 1) * self.batch_size]]
            yield xb, self.labels[sel]
