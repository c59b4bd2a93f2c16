"""Loaders for the data formats hospitals and researchers already have.

Every loader reads files in their published layout, unchanged, and returns an
:class:`~fedderm.data.pool.ImagePool` (all images decoded and resized to one square size):

* :func:`load_folder` (:mod:`fedderm.data.folder`): ``root/<class>/<image>`` (torchvision
  ``ImageFolder``) or ``root/<site>/<class>/<image>``.
* :func:`load_csv` (:mod:`fedderm.data.tables`): an ISIC 2019 ground-truth CSV (``image`` + one-hot
  class columns) or the HAM10000 metadata (``image_id``, ``dx``, ``lesion_id``, ``dataset``) next to
  an image folder.
* :func:`load_npz` (:mod:`fedderm.data.npz`): a MedMNIST ``.npz`` archive (train, val and test
  splits pooled).

:func:`load_source` dispatches on a dataset-type name. The loaders share the decode layer of
:mod:`fedderm.data.decode` (argument checks, file discovery, parallel decoding) and the cache of
decoded pools of :mod:`fedderm.data.cache`. The names below stay importable from here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedderm.data.cache import CACHE_VERSION
from fedderm.data.decode import MAX_IMAGE_PIXELS
from fedderm.data.decode import _read_image as _read_image  # re-exported for older importers
from fedderm.data.folder import IMAGE_EXTENSIONS, load_folder
from fedderm.data.npz import NPZ_SPLITS, load_npz
from fedderm.data.pool import DataError, ImagePool
from fedderm.data.tables import CSV_IMAGE_EXTENSIONS, load_csv

__all__ = [
    "CACHE_VERSION",
    "CSV_IMAGE_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "LOADERS",
    "MAX_IMAGE_PIXELS",
    "NPZ_SPLITS",
    "load_csv",
    "load_folder",
    "load_npz",
    "load_source",
]


#: Loader per dataset-type name, as used by :func:`load_source`.
LOADERS: dict[str, Callable[..., ImagePool]] = {
    "folder": load_folder,
    "csv": load_csv,
    "npz": load_npz,
}


def load_source(dataset: str, path: str | Path, image_size: int, **kwargs: Any) -> ImagePool:
    """Load ``path`` with the loader registered as ``dataset`` in :data:`LOADERS`.

    ``kwargs`` are passed on unchanged (e.g. ``cache_dir``, ``classes``, ``site_column``).
    """
    try:
        loader = LOADERS[dataset]
    except KeyError:
        raise DataError(
            f"unknown dataset type {dataset!r}; valid types: {', '.join(sorted(LOADERS))}"
        ) from None
    return loader(path, image_size, **kwargs)
