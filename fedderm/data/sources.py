"""Loaders for the data formats hospitals and researchers already have.

Every loader reads files in their published layout, unchanged, and returns an
:class:`~fedderm.data.pool.ImagePool` (all images decoded and resized to one square size):

* :func:`load_folder`: ``root/<class>/<image>`` (torchvision ``ImageFolder``) or
  ``root/<site>/<class>/<image>``.
* :func:`load_csv`: an ISIC 2019 ground-truth CSV (``image`` + one-hot class columns) or the
  HAM10000 metadata (``image_id``, ``dx``, ``lesion_id``, ``dataset``) next to an image folder.
* :func:`load_npz`: a MedMNIST ``.npz`` archive (train, val and test splits pooled).

:func:`load_source` dispatches on a dataset-type name. Decoding image files is the slow
part: with ``cache_dir`` the decoded pool is stored once as a ``.pt`` file whose name
hashes the inputs (paths, sizes and modification times of every file, and the arguments),
so an unchanged data set is decoded once and any changed file triggers a fresh decode.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fedderm.data.names import medmnist_names
from fedderm.data.pool import DataError, ImagePool, resize_square

if TYPE_CHECKING:  # pandas is imported where a CSV is read: most processes never need it
    import pandas as pd

__all__ = [
    "CACHE_VERSION",
    "CSV_IMAGE_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "LOADERS",
    "load_csv",
    "load_folder",
    "load_npz",
    "load_source",
]

logger = logging.getLogger("fedderm.data")

#: Bump whenever decoding or the cache layout changes, to invalidate old cache files.
CACHE_VERSION = 1
#: Image files read by :func:`load_folder` (compared case-insensitively).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff")
#: Image files looked up for the extension-less ids of a CSV (compared case-insensitively).
CSV_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
#: MedMNIST split names, pooled in this order.
NPZ_SPLITS = ("train", "val", "test")

_IGNORED_NAMES = frozenset({"__MACOSX"})  # macOS zip debris, never a class or a site
_LOG_EVERY = 1000  # decoded images between progress messages
_NPZ_CHUNK = 256  # images resized per interpolate call
_MAX_LISTED = 5  # problems spelled out in one error message
_ISIC_ID, _HAM_ID, _HAM_LABEL, _GROUP_COLUMN, _AUTO_SITE_COLUMN = (
    "image", "image_id", "dx", "lesion_id", "dataset")


# --------------------------------------------------------------------------------------
# Public loaders
# --------------------------------------------------------------------------------------


def load_folder(
    root: str | Path,
    image_size: int,
    *,
    skip_bad_files: bool = False,
    cache_dir: str | Path | None = None,
    classes: Sequence[str] | None = None,
) -> ImagePool:
    """Load ``root/<class>/<image>`` or ``root/<site>/<class>/<image>``.

    The site layout is chosen when every top-level folder holds at least one folder and
    no image file directly; site names are then the top-level folders and classes the
    sorted union of the class folder names. Images are searched recursively under each
    class folder (extensions :data:`IMAGE_EXTENSIONS`, any case); hidden files and folders
    are ignored.

    Args:
        root: the data set folder.
        image_size: side of the square images in the returned pool.
        skip_bad_files: skip (and list in ``pool.skipped``) unreadable images and images
            of a class not in ``classes`` instead of raising :class:`DataError`.
        cache_dir: where to keep the decoded pool between runs; ``None`` disables caching.
        classes: the class list (label order); default: the sorted class folder names.

    Raises:
        DataError: missing or empty ``root``, unreadable image, class not in ``classes``.
    """
    _check_image_size(image_size)
    wanted = _check_classes(classes)
    root = _existing_path(root, "image folder", want_dir=True)
    scan = _scan_folder(root)
    key = _cache_key("folder", root, image_size, skip_bad_files, wanted,
                     files=_fingerprint(scan.paths, root))

    def build() -> ImagePool:
        listing = _folder_listing(scan, wanted, skip_bad_files)
        return _decode_listing(listing, image_size, skip_bad_files, source=root)

    return _cached(cache_dir, key, build)


def load_csv(
    csv_path: str | Path,
    image_size: int,
    *,
    skip_bad_files: bool = False,
    cache_dir: str | Path | None = None,
    classes: Sequence[str] | None = None,
    image_dir: str | Path | None = None,
    site_column: str | None = "auto",
) -> ImagePool:
    """Load an ISIC 2019 ground-truth CSV or the HAM10000 metadata with their images.

    Layouts (detected from the columns; the file may have no extension):

    * ISIC 2019: ``image`` + one-hot float columns (``MEL,NV,...,UNK``). Classes are those
      columns in file order (every column except ``image``, ``lesion_id`` and the site
      column); each row must hold exactly one ``1`` and zeros elsewhere.
    * HAM10000: ``image_id`` + ``dx``; classes are the sorted ``dx`` values. ``lesion_id``
      (either layout) gives ``pool.groups``.

    Image ids have no extension: ``<id>.jpg|.jpeg|.png`` (any case) is looked up among all
    files under ``image_dir``, searched recursively once.

    Args:
        csv_path: the ground-truth / metadata file.
        image_size: side of the square images in the returned pool.
        skip_bad_files: skip (and list in ``pool.skipped``) bad rows, missing and unreadable
            images instead of raising :class:`DataError`.
        cache_dir: where to keep the decoded pool between runs; ``None`` disables caching.
        classes: the class list (label order); a label outside it is an error.
        image_dir: folder holding the images; default: the CSV's folder.
        site_column: column giving each image's site: ``"auto"`` uses ``dataset`` when
            present (HAM10000), ``""`` or ``None`` means no sites.

    Raises:
        DataError: unknown layout, missing column, bad row, missing or unreadable image.
    """
    _check_image_size(image_size)
    wanted = _check_classes(classes)
    csv_path = _existing_path(csv_path, "CSV file")
    image_dir = (csv_path.parent if image_dir is None
                 else _existing_path(image_dir, "image folder", want_dir=True))
    image_files = _walk_images(image_dir, CSV_IMAGE_EXTENSIONS)
    key = _cache_key("csv", csv_path, image_size, skip_bad_files, wanted,
                     files=_fingerprint([csv_path], csv_path.parent)
                     + _fingerprint(image_files, image_dir),
                     image_dir=str(image_dir), site_column=site_column)

    def build() -> ImagePool:
        table = _read_table(csv_path, site_column)
        rows = _parse_rows(table, csv_path, _resolve_site_column(table, csv_path, site_column))
        listing = _csv_listing(rows, wanted, _index_by_stem(image_files), csv_path, image_dir,
                               skip_bad_files)
        return _decode_listing(listing, image_size, skip_bad_files, source=csv_path)

    return _cached(cache_dir, key, build)


def load_npz(
    path: str | Path,
    image_size: int,
    *,
    skip_bad_files: bool = False,
    cache_dir: str | Path | None = None,
    classes: Sequence[str] | None = None,
) -> ImagePool:
    """Load a MedMNIST ``.npz``: the train, val and test splits pooled in that order.

    Images are ``uint8`` ``(N, H, W)`` grayscale or ``(N, H, W, 3)`` RGB; they are resized
    like :func:`~fedderm.data.pool.resize_square` (shorter edge, bilinear with antialiasing,
    center crop). Labels are ``(N,)`` or ``(N, 1)`` integers; multi-label files such as
    ChestMNIST are rejected.

    Args:
        path: the ``.npz`` file.
        image_size: side of the square images in the returned pool.
        skip_bad_files: skip (and list in ``pool.skipped``) samples whose label is outside
            ``classes`` instead of raising :class:`DataError`.
        cache_dir: where to keep the resized pool between runs; ``None`` disables caching.
        classes: class names for labels ``0..len(classes)-1``; default: MedMNIST's names when
            the file is named after a MedMNIST data set (:mod:`fedderm.data.names`), else
            ``"0", "1", ...``.

    Raises:
        DataError: not an ``.npz``, missing key, bad shape or dtype, label out of range.
    """
    _check_image_size(image_size)
    wanted = _check_classes(classes)
    path = _existing_path(path, ".npz file")
    key = _cache_key("npz", path, image_size, skip_bad_files, wanted,
                     files=_fingerprint([path], path.parent))
    pool = _cached(cache_dir, key, lambda: _build_npz(path, image_size, wanted, skip_bad_files))
    return _medmnist_named(pool, path) if wanted is None else pool


def _medmnist_named(pool: ImagePool, path: Path) -> ImagePool:
    """``pool`` with MedMNIST's class names when ``path`` is named after a MedMNIST data set
    (``dermamnist.npz`` -> ``"actinic keratoses and intraepithelial carcinoma", ...``)."""
    names = medmnist_names(path)
    if names is None or len(pool.classes) > len(names):
        return pool
    logger.info("%s: MedMNIST class names %s", path.name, names[:len(pool.classes)])
    return dataclasses.replace(pool, classes=names[:len(pool.classes)])


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
        raise DataError(f"unknown dataset type {dataset!r}; valid types: "
                        f"{', '.join(sorted(LOADERS))}") from None
    return loader(path, image_size, **kwargs)


# --------------------------------------------------------------------------------------
# Argument checks and file discovery
# --------------------------------------------------------------------------------------


def _check_image_size(image_size: int) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")


def _check_classes(classes: Sequence[str] | None) -> list[str] | None:
    if classes is None:
        return None
    if isinstance(classes, str):
        raise ValueError(f"classes must be a list of names, got the string {classes!r}")
    names = [str(c) for c in classes]
    if not names:
        raise ValueError("classes must not be empty (pass None to infer them)")
    dupes = sorted({c for c in names if names.count(c) > 1})
    if dupes:
        raise ValueError(f"classes contains duplicates: {dupes}")
    return names


def _existing_path(path: str | Path, what: str, want_dir: bool = False) -> Path:
    """Absolute ``path`` (``~`` expanded), checked to exist and be a folder / a file."""
    if not str(path).strip():
        raise DataError(f"no {what} given (empty path)")
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise DataError(f"{what} not found: {path}")
    if want_dir and not path.is_dir():
        raise DataError(f"{what} is not a folder: {path}")
    if not want_dir and path.is_dir():
        raise DataError(f"{what} is a folder, expected a file: {path}")
    return path


def _visible(name: str) -> bool:
    return not name.startswith(".") and name not in _IGNORED_NAMES


def _subdirs(folder: Path) -> list[Path]:
    """Visible sub-folders of ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if _visible(p.name) and p.is_dir())


def _has_ext(name: str, extensions: Sequence[str]) -> bool:
    return name.lower().endswith(tuple(extensions))


def _walk_images(root: Path, extensions: Sequence[str]) -> list[Path]:
    """Visible image files under ``root`` (recursive, symlinks followed), sorted by path."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if _visible(d))
        found.extend(Path(folder, f) for f in files if _visible(f) and _has_ext(f, extensions))
    return sorted(found)


def _fingerprint(paths: Iterable[Path], base: Path) -> list[tuple[str, int, int]]:
    """``(path relative to base, size, mtime_ns)`` of each file: what the cache key hashes."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((os.path.relpath(p, base), st.st_size, st.st_mtime_ns))
    return sorted(out)


# --------------------------------------------------------------------------------------
# Decoding image files
# --------------------------------------------------------------------------------------


@dataclass
class _Listing:
    """Image files to decode, with their labels and optional site / group codes."""

    paths: list[Path]
    labels: np.ndarray
    classes: list[str]
    sites: np.ndarray | None = None
    site_names: list[str] = field(default_factory=list)
    groups: np.ndarray | None = None
    skipped: list[str] = field(default_factory=list)


def _read_image(path: Path, size: int) -> np.ndarray:
    """Decode one image file into a ``(size, size, 3)`` ``uint8`` array."""
    try:
        with Image.open(path) as img:
            img.draft(None, (size, size))  # JPEG: decode at 1/2..1/8 scale, never below size
            return resize_square(img, size)
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, struct.error...)
        raise DataError(f"cannot decode image {path}: {type(exc).__name__}: {exc}") from exc


def _try_read_image(path: Path, size: int) -> np.ndarray | DataError:
    try:
        return _read_image(path, size)
    except DataError as exc:
        return exc


def _decode_files(paths: Sequence[Path], size: int, skip_bad: bool,
                  source: Path) -> tuple[torch.Tensor, list[int], list[str]]:
    """Decode ``paths`` in parallel threads (Pillow releases the GIL).

    Returns the images of the readable files ``(K, 3, size, size)``, their indices in
    ``paths`` and the skipped paths. Raises the first :class:`DataError` unless ``skip_bad``.
    """
    n = len(paths)
    images = torch.empty((n, 3, size, size), dtype=torch.uint8)
    kept: list[int] = []
    skipped: list[str] = []
    logger.info("decoding %d images from %s at %dx%d (%.2f GB in memory)",
                n, source, size, size, images.numel() / 1e9)
    executor = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                  thread_name_prefix="fedderm-decode")
    try:
        for i, result in enumerate(executor.map(_try_read_image, paths, [size] * n)):
            if isinstance(result, DataError):
                if not skip_bad:
                    raise DataError(f"{result} (set skip-bad-files=true to skip unreadable "
                                    "images)") from result
                logger.warning("skipping unreadable image: %s", result)
                skipped.append(str(paths[i]))
            else:
                images[len(kept)] = torch.from_numpy(result).permute(2, 0, 1)
                kept.append(i)
            if (i + 1) % _LOG_EVERY == 0 or i + 1 == n:
                logger.info("decoded %d/%d images from %s", i + 1, n, source)
    finally:  # on an error (or Ctrl-C) don't decode the rest before raising
        executor.shutdown(wait=True, cancel_futures=True)
    if len(kept) < n:
        images = images[: len(kept)].clone()  # drop the unused tail of the buffer
    return images, kept, skipped


def _decode_listing(listing: _Listing, size: int, skip_bad: bool, source: Path) -> ImagePool:
    """Decode the files of ``listing`` into an :class:`ImagePool`."""
    images, kept, skipped = _decode_files(listing.paths, size, skip_bad, source)
    if not kept:
        raise DataError(f"no readable images in {source} "
                        f"({len(listing.skipped) + len(skipped)} skipped)")
    idx = np.asarray(kept, dtype=np.int64)
    return ImagePool(
        images=images,
        labels=listing.labels[idx],
        classes=listing.classes,
        sites=None if listing.sites is None else listing.sites[idx],
        site_names=listing.site_names,
        groups=None if listing.groups is None else _renumber(listing.groups[idx]),
        skipped=listing.skipped + skipped,
    )


def _renumber(codes: np.ndarray) -> np.ndarray:
    """Map codes to ``0..K-1`` keeping their order."""
    return np.unique(codes, return_inverse=True)[1].astype(np.int64)


def _encode(values: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """Sorted unique names of ``values`` and each value's index in them."""
    names, codes = np.unique(np.asarray(values, dtype=str), return_inverse=True)
    return names.tolist(), codes.astype(np.int64)


def _group_codes(keys: Sequence[str | None]) -> np.ndarray:
    """Codes numbering group keys by first appearance; each ``None`` is a group of its own."""
    codes: dict[Any, int] = {}
    return np.asarray([codes.setdefault(k if k is not None else (i,), len(codes))
                       for i, k in enumerate(keys)], dtype=np.int64)


def _label_indices(names: Sequence[str], classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Index of each name in ``classes`` (``-1`` if absent) and the mask of absent ones."""
    lookup = {c: i for i, c in enumerate(classes)}
    idx = np.fromiter((lookup.get(n, -1) for n in names), dtype=np.int64, count=len(names))
    return idx, idx < 0


def _raise_or_skip(problems: list[tuple[str, str]], skip_bad: bool, header: str,
                   prefix: str = "") -> list[str]:
    """Raise one :class:`DataError` listing ``(what, why)`` problems, or return the ``what``s.

    With ``skip_bad`` the problems are logged and ``prefix + what`` returned for ``skipped``.
    """
    if not problems:
        return []
    if skip_bad:
        logger.warning("skipping %d entries: %s", len(problems), header)
        for what, why in problems:
            logger.debug("skipped %s: %s", what, why)
        return [prefix + what for what, _ in problems]
    listed = "; ".join(f"{what}: {why}" for what, why in problems[:_MAX_LISTED])
    more = f"; ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise DataError(f"{header} ({len(problems)}): {listed}{more} "
                    "(set skip-bad-files=true to skip them)")


# --------------------------------------------------------------------------------------
# Image folders
# --------------------------------------------------------------------------------------


@dataclass
class _FolderScan:
    paths: list[Path]
    class_of: list[str]  # class folder name of each path
    site_of: list[str] | None  # site folder name of each path (site layout only)
    class_names: list[str]  # every class folder name, sorted
    site_names: list[str] | None  # every site folder name, sorted (site layout only)


def _is_site_dir(folder: Path) -> bool:
    """A site folder holds class folders and no image file directly."""
    entries = [p for p in folder.iterdir() if _visible(p.name)]
    has_dirs = any(p.is_dir() for p in entries)
    has_images = any(p.is_file() and _has_ext(p.name, IMAGE_EXTENSIONS) for p in entries)
    return has_dirs and not has_images


def _scan_folder(root: Path) -> _FolderScan:
    top = _subdirs(root)
    if not top:
        raise DataError(f"no class folders in {root}: expected root/<class>/<image> "
                        "or root/<site>/<class>/<image>")
    if all(_is_site_dir(d) for d in top):
        class_dirs = [(site.name, cls) for site in top for cls in _subdirs(site)]
        site_names: list[str] | None = [d.name for d in top]
    else:
        class_dirs = [(None, cls) for cls in top]
        site_names = None
    paths, class_of, site_of = [], [], []
    for site, cls in class_dirs:
        for p in _walk_images(cls, IMAGE_EXTENSIONS):
            paths.append(p)
            class_of.append(cls.name)
            site_of.append(site)
    if not paths:
        raise DataError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) found in {root}")
    return _FolderScan(paths=paths, class_of=class_of,
                       site_of=None if site_names is None else site_of,
                       class_names=sorted({cls.name for _, cls in class_dirs}),
                       site_names=site_names)


def _folder_listing(scan: _FolderScan, wanted: list[str] | None, skip_bad: bool) -> _Listing:
    classes = wanted if wanted is not None else scan.class_names
    labels, bad = _label_indices(scan.class_of, classes)
    problems = [(str(scan.paths[i]), f"class folder {scan.class_of[i]!r} is not in the given "
                 f"classes {classes}") for i in np.flatnonzero(bad)]
    skipped = _raise_or_skip(problems, skip_bad, "images of a class not in the class list")
    keep = np.flatnonzero(~bad)
    sites = None
    if scan.site_of is not None:
        site_index = {s: i for i, s in enumerate(scan.site_names)}
        sites = np.asarray([site_index[scan.site_of[i]] for i in keep], dtype=np.int64)
    return _Listing(paths=[scan.paths[i] for i in keep], labels=labels[keep], classes=classes,
                    sites=sites, site_names=scan.site_names or [], skipped=skipped)


# --------------------------------------------------------------------------------------
# CSV + image folder (ISIC 2019, HAM10000)
# --------------------------------------------------------------------------------------


@dataclass
class _Rows:
    """What a CSV says about each image; ``None`` labels mark invalid rows."""

    csv_classes: list[str] | None  # classes defined by the file (ISIC), else None
    ids: list[str]
    labels: list[str | None]
    problems: dict[int, str]  # row position -> why its label is invalid
    sites: list[str | None] | None
    groups: list[str | None] | None


def _line(row: int) -> int:
    """File line of 0-based data row ``row`` (line 1 is the header)."""
    return row + 2


def _read_table(csv_path: Path, site_column: str | None) -> pd.DataFrame:
    """The CSV with its id, label, group and site columns read as text."""
    import pandas as pd

    named = (_ISIC_ID, _HAM_ID, _HAM_LABEL, _GROUP_COLUMN, _AUTO_SITE_COLUMN, site_column)
    text_columns = {c: str for c in named if c and c != "auto"}
    try:
        table = pd.read_csv(csv_path, dtype=text_columns, encoding="utf-8-sig",
                            skipinitialspace=True)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"cannot read CSV {csv_path}: {exc}") from exc
    table.columns = [str(c).strip() for c in table.columns]
    if table.empty:
        raise DataError(f"CSV {csv_path} has no data rows (columns: {list(table.columns)})")
    return table


def _resolve_site_column(table: pd.DataFrame, csv_path: Path, site_column: str | None) -> str | None:
    if site_column == "auto":
        return _AUTO_SITE_COLUMN if _AUTO_SITE_COLUMN in table.columns else None
    if not site_column:
        return None
    if site_column not in table.columns:
        raise DataError(f"site column {site_column!r} not found in {csv_path}; "
                        f"columns: {list(table.columns)}")
    return site_column


def _text(table: pd.DataFrame, column: str) -> list[str | None]:
    """Column values as stripped strings, ``None`` where empty."""
    import pandas as pd

    return [None if pd.isna(v) or not str(v).strip() else str(v).strip()
            for v in table[column].to_numpy(dtype=object)]


def _parse_rows(table: pd.DataFrame, csv_path: Path, site_column: str | None) -> _Rows:
    """Detect the layout of ``table`` and extract ids, label names, sites and groups."""
    import pandas as pd

    columns = list(table.columns)
    reserved = {_ISIC_ID, _GROUP_COLUMN, site_column}
    one_hot = [c for c in columns if c not in reserved and not c.startswith("Unnamed: ")]
    if _ISIC_ID in columns and one_hot and all(
            pd.api.types.is_numeric_dtype(table[c]) for c in one_hot):
        ids = _text(table, _ISIC_ID)
        csv_classes = one_hot
        labels, problems = _one_hot_labels(table, one_hot)
    elif _HAM_ID in columns and _HAM_LABEL in columns:
        ids = _text(table, _HAM_ID)
        csv_classes, labels = None, _text(table, _HAM_LABEL)
        problems = {i: f"empty {_HAM_LABEL!r}" for i, v in enumerate(labels) if v is None}
    else:
        raise DataError(_layout_error(table, csv_path, one_hot))
    for i, v in enumerate(ids):
        if v is None:
            problems.setdefault(i, "empty image id")
    sites = None if site_column is None else _text(table, site_column)
    for i, v in enumerate(sites or []):
        if v is None:
            problems.setdefault(i, f"empty site column {site_column!r}")
    groups = _text(table, _GROUP_COLUMN) if _GROUP_COLUMN in columns else None
    return _Rows(csv_classes=csv_classes, ids=ids, labels=labels, problems=problems,
                 sites=sites, groups=groups)


def _one_hot_labels(table: pd.DataFrame, columns: list[str]) -> tuple[list[str | None], dict[int, str]]:
    """Label name of each one-hot row; rows without exactly one 1 (rest 0) are problems."""
    values = table[columns].to_numpy(dtype=np.float64)
    valid = np.isin(values, (0.0, 1.0)).all(axis=1) & ((values == 1.0).sum(axis=1) == 1)
    winners = values.argmax(axis=1)
    labels = [columns[w] if ok else None for w, ok in zip(winners, valid)]
    problems = {int(i): "expected exactly one 1.0 among the class columns, got "
                + ", ".join(f"{c}={v:g}" for c, v in zip(columns, values[i]))
                for i in np.flatnonzero(~valid)}
    return labels, problems


def _layout_error(table: pd.DataFrame, csv_path: Path, one_hot: list[str]) -> str:
    import pandas as pd

    msg = (f"unrecognised CSV layout in {csv_path}: found columns {list(table.columns)}; "
           f"expected {_ISIC_ID!r} + one-hot numeric class columns (ISIC 2019 ground truth) "
           f"or {_HAM_ID!r} + {_HAM_LABEL!r} (HAM10000 metadata)")
    text = [c for c in one_hot if not pd.api.types.is_numeric_dtype(table[c])]
    if _ISIC_ID in table.columns and text:
        msg += (f"; non-numeric columns {text} cannot be one-hot classes "
                "(if one holds sites, pass site_column=<its name>)")
    return msg


def _index_by_stem(files: Sequence[Path]) -> dict[str, Path]:
    """Map file name without extension to path; on duplicates the first path (sorted) wins."""
    index: dict[str, Path] = {}
    dupes = 0
    for p in files:
        if p.stem in index:
            dupes += 1
        else:
            index[p.stem] = p
    if dupes:
        logger.warning("%d image files share a name with another file; using the first path "
                       "of each name in sorted order", dupes)
    return index


def _find_image(image_id: str, index: dict[str, Path]) -> Path | None:
    """The file of ``image_id``, also accepting ids written with an image extension."""
    if image_id in index:
        return index[image_id]
    if _has_ext(image_id, CSV_IMAGE_EXTENSIONS):
        return index.get(Path(image_id).stem)
    return None


def _csv_listing(rows: _Rows, wanted: list[str] | None, index: dict[str, Path], csv_path: Path,
                 image_dir: Path, skip_bad: bool) -> _Listing:
    """Match rows to image files; report bad rows, then missing images."""
    n = len(rows.ids)
    if wanted is not None:
        classes = wanted
    elif rows.csv_classes is not None:
        classes = rows.csv_classes
    else:
        classes = sorted({v for v in rows.labels if v is not None})
    labels, unknown = _label_indices([v or "" for v in rows.labels], classes)

    def where(i: int) -> str:
        return f"line {_line(i)} (image {rows.ids[i]!r})"

    problems = dict(rows.problems)
    for i in np.flatnonzero(unknown):
        problems.setdefault(int(i), f"label {rows.labels[i]!r} is not in the classes {classes}")
    skipped = _raise_or_skip([(where(i), why) for i, why in sorted(problems.items())],
                             skip_bad, f"bad rows in {csv_path}", prefix=f"{csv_path} ")

    paths = [None if i in problems else _find_image(rows.ids[i], index) for i in range(n)]
    missing = [i for i in range(n) if i not in problems and paths[i] is None]
    exts = "/".join(CSV_IMAGE_EXTENSIONS)
    header = (f"images listed in {csv_path} not found in {image_dir} (searched recursively "
              f"for <id>{exts}; {len(index)} image files there)")
    skipped += _raise_or_skip([(where(i), "no such file") for i in missing], skip_bad, header,
                              prefix=f"{csv_path} ")

    keep = np.asarray([i for i in range(n) if paths[i] is not None], dtype=np.int64)
    if keep.size == 0:
        raise DataError(f"no usable rows in {csv_path} ({len(skipped)} skipped)")
    sites, site_names = None, []
    if rows.sites is not None:
        site_names, sites = _encode([rows.sites[i] for i in keep])
    groups = None
    if rows.groups is not None:
        groups = _group_codes([rows.groups[i] for i in keep])
    return _Listing(paths=[paths[i] for i in keep], labels=labels[keep], classes=classes,
                    sites=sites, site_names=site_names, groups=groups, skipped=skipped)


# --------------------------------------------------------------------------------------
# MedMNIST .npz
# --------------------------------------------------------------------------------------


def _build_npz(path: Path, size: int, wanted: list[str] | None, skip_bad: bool) -> ImagePool:
    splits = _read_npz(path)
    labels = np.concatenate([lab for _, lab in splits])
    if labels.size == 0:
        raise DataError(f"{path} holds no images")
    if wanted is not None:
        classes = wanted
    else:
        classes = [str(i) for i in range(max(int(labels.max()), 0) + 1)]
    bad = (labels < 0) | (labels >= len(classes))
    problems, offset = [], 0
    for split, (_, lab) in zip(NPZ_SPLITS, splits):
        for i in np.flatnonzero(bad[offset: offset + len(lab)]):
            problems.append((f"{path}: {split}_labels[{i}]", f"label {int(lab[i])} is outside "
                             f"0..{len(classes) - 1} (classes {classes})"))
        offset += len(lab)
    skipped = _raise_or_skip(problems, skip_bad, f"labels out of range in {path}")
    keep = np.flatnonzero(~bad)
    if keep.size == 0:
        raise DataError(f"no usable samples in {path} ({len(skipped)} skipped)")
    logger.info("resizing %d images from %s to %dx%d", labels.size, path, size, size)
    images = torch.empty((labels.size, 3, size, size), dtype=torch.uint8)
    offset = 0
    for split_images, _ in splits:
        _resize_into(images[offset: offset + len(split_images)], split_images)
        offset += len(split_images)
    if keep.size < labels.size:
        images = images[torch.from_numpy(keep)]
    return ImagePool(images=images, labels=labels[keep], classes=classes, skipped=skipped)


def _read_npz(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(images, labels)`` of each split, checked; images ``(N,H,W)`` or ``(N,H,W,3)``."""
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError, OSError, BadZipFile, EOFError...
        raise DataError(f"not a valid .npz file: {path} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"not a valid .npz file: {path} (it holds a single array, "
                        "expected the MedMNIST keys train_images, train_labels, ...)")
    with archive:
        return [_npz_split(archive, split, path) for split in NPZ_SPLITS]


def _npz_split(archive: Any, split: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = (_npz_array(archive, f"{split}_{kind}", path) for kind in ("images", "labels"))
    key = f"{split}_images"
    if images.dtype != np.uint8:
        raise DataError(f"{path}: {key!r} must be uint8, got {images.dtype}")
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if not (images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)):
        raise DataError(f"{path}: {key!r} must have shape (N, H, W) or (N, H, W, 3), "
                        f"got {images.shape}")
    return images, _npz_labels(labels, len(images), f"{split}_labels", path)


def _npz_array(archive: Any, key: str, path: Path) -> np.ndarray:
    if key not in archive.files:
        raise DataError(f"key {key!r} missing from {path}; keys found: {sorted(archive.files)}")
    try:
        return archive[key]
    except Exception as exc:  # a damaged member: BadZipFile, ValueError, EOFError...
        raise DataError(f"cannot read {key!r} from {path}: {type(exc).__name__}: {exc}") from exc


def _npz_labels(labels: np.ndarray, n: int, key: str, path: Path) -> np.ndarray:
    if labels.ndim == 2 and labels.shape[1] > 1:
        raise DataError(f"{path}: {key!r} has shape {labels.shape}: multi-label files "
                        "(e.g. ChestMNIST) are not supported; expected one integer label per image")
    if labels.ndim == 2:
        labels = labels[:, 0]
    if labels.ndim != 1 or len(labels) != n:
        raise DataError(f"{path}: {key!r} must have shape ({n},) or ({n}, 1), got {labels.shape}")
    if labels.dtype.kind not in "iu":
        raise DataError(f"{path}: {key!r} must hold integers, got {labels.dtype}")
    return labels.astype(np.int64)


def _resize_into(out: torch.Tensor, images: np.ndarray) -> None:
    """Resize ``(N,H,W)`` / ``(N,H,W,3)`` ``uint8`` into ``out`` ``(N,3,S,S)`` like ``resize_square``.

    Grayscale is replicated to 3 channels; work is chunked to bound float32 memory.
    """
    batch = torch.from_numpy(np.ascontiguousarray(images))
    batch = batch.unsqueeze(1) if batch.ndim == 3 else batch.permute(0, 3, 1, 2)
    n, _, h, w = batch.shape
    size = out.shape[-1]
    if n == 0:
        return
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    for start in range(0, n, _NPZ_CHUNK):
        chunk = batch[start: start + _NPZ_CHUNK]
        if (new_h, new_w) != (h, w):
            chunk = F.interpolate(chunk.float(), size=(new_h, new_w), mode="bilinear",
                                  align_corners=False, antialias=True)
            chunk = chunk.round_().clamp_(0, 255).to(torch.uint8)
        out[start: start + len(chunk)] = chunk[:, :, top: top + size, left: left + size]


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def _cache_key(loader: str, path: Path, image_size: int, skip_bad: bool,
               classes: list[str] | None, files: list[tuple[str, int, int]], **extra: Any) -> str:
    """Hex digest of everything the decoded pool depends on."""
    parts = {"version": CACHE_VERSION, "loader": loader, "path": str(path),
             "image_size": int(image_size), "skip_bad_files": bool(skip_bad),
             "classes": classes, "files": files, **extra}
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return f"{loader}-{hashlib.sha256(blob).hexdigest()[:32]}"


def _cached(cache_dir: str | Path | None, key: str, build: Callable[[], ImagePool]) -> ImagePool:
    """``build()``, or its result stored in ``cache_dir/<key>.pt`` by an earlier call."""
    if cache_dir is None:
        return build()
    cache_file = Path(cache_dir).expanduser() / f"{key}.pt"
    pool = _read_cache(cache_file)
    if pool is not None:
        logger.info("loaded %d images from cache %s", len(pool), cache_file)
        return pool
    pool = build()
    _write_cache(pool, cache_file)
    return pool


def _read_cache(cache_file: Path) -> ImagePool | None:
    if not cache_file.is_file():
        return None
    try:
        data = torch.load(cache_file, map_location="cpu", weights_only=True, mmap=True)
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"cache version {data.get('version')} != {CACHE_VERSION}")
        as_numpy = lambda t: None if t is None else t.numpy()  # noqa: E731
        return ImagePool(images=data["images"], labels=as_numpy(data["labels"]),
                         classes=data["classes"], sites=as_numpy(data["sites"]),
                         site_names=data["site_names"], groups=as_numpy(data["groups"]),
                         skipped=data["skipped"])
    except Exception as exc:  # a truncated or foreign file: decode again and overwrite it
        logger.warning("ignoring unreadable cache file %s (%s: %s)", cache_file,
                       type(exc).__name__, exc)
        return None


def _write_cache(pool: ImagePool, cache_file: Path) -> None:
    """Store ``pool`` atomically (temporary file + rename); failures are only logged."""
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    images = pool.images.contiguous()
    if images.untyped_storage().nbytes() != images.numel():  # a view: don't save the whole base
        images = images.clone()
    data = {"version": CACHE_VERSION, "images": images, "labels": as_tensor(pool.labels),
            "classes": list(pool.classes), "sites": as_tensor(pool.sites),
            "site_names": list(pool.site_names), "groups": as_tensor(pool.groups),
            "skipped": list(pool.skipped)}
    tmp = None
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=f".{cache_file.name}.",
                                   suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
        os.replace(tmp, cache_file)
        tmp = None
        logger.info("cached %d images in %s", len(pool), cache_file)
    except OSError as exc:
        logger.warning("could not write cache file %s: %s", cache_file, exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
