"""The decode layer shared by the loaders (:mod:`fedderm.data.sources`): argument checks, file
discovery, and decoding a :class:`_Listing` (image files with their labels, sites and groups) into an
:class:`~fedderm.data.pool.ImagePool` in parallel threads.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from fedderm.data.pool import DataError, ImagePool, resize_square

logger = logging.getLogger("fedderm.data")

_IGNORED_NAMES = frozenset({"__MACOSX"})  # macOS zip debris, never a class or a site
_LOG_EVERY = 1000  # decoded images between progress messages
_MAX_LISTED = 5  # problems spelled out in one error message
#: Names of the data's own splits (a CSV ``split`` value, a top-level folder; compared
#: case-insensitively) -> their code in :data:`fedderm.data.pool.SPLIT_NAMES`.
SPLIT_ALIASES = {"train": 0, "training": 0, "val": 1, "valid": 1, "validation": 1, "test": 2, "testing": 2}


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


def _split_code(name: str | None) -> int | None:
    """Code of a split name (``"Test"`` -> 2), ``None`` for anything else."""
    return None if name is None else SPLIT_ALIASES.get(name.strip().lower())


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


# --------------------------------------------------------------------------------------
# Decoding image files
# --------------------------------------------------------------------------------------


@dataclass
class _Listing:
    """Image files to decode, with their labels and optional site / group / split codes."""

    paths: list[Path]
    labels: np.ndarray
    classes: list[str]
    sites: np.ndarray | None = None
    site_names: list[str] = field(default_factory=list)
    groups: np.ndarray | None = None
    skipped: list[str] = field(default_factory=list)
    splits: np.ndarray | None = None  # the data's own split of each file (pool.SPLIT_NAMES codes)


#: Largest image decoded (pixels): a whole-slide scan above it is refused with a message naming the
#: file, instead of Pillow's DecompressionBombWarning (it warns above half of it, silenced here).
MAX_IMAGE_PIXELS = 16384 * 16384
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS // 2
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)  # once: decoding runs in threads


def _read_image(path: Path, size: int) -> np.ndarray:
    """Decode one image file into a ``(size, size, 3)`` ``uint8`` array."""
    try:
        with Image.open(path) as img:
            img.draft(None, (size, size))  # JPEG: decode at 1/2..1/8 scale, never below size
            return resize_square(img, size)
    except Image.DecompressionBombError:
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        raise DataError(
            f"image {path} has more than {limit:,} pixels, fedderm's decode limit "
            "(fedderm.data.decode.MAX_IMAGE_PIXELS): downscale it first"
        ) from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, struct.error...)
        raise DataError(f"cannot decode image {path}: {type(exc).__name__}: {exc}") from exc


def _try_read_image(path: Path, size: int) -> np.ndarray | DataError:
    try:
        return _read_image(path, size)
    except DataError as exc:
        return exc


def _decode_files(
    paths: Sequence[Path], size: int, skip_bad: bool, source: Path
) -> tuple[torch.Tensor, list[int], list[str]]:
    """Decode ``paths`` in parallel threads (Pillow releases the GIL).

    Returns the images of the readable files ``(K, 3, size, size)``, their indices in
    ``paths`` and the skipped paths. Raises the first :class:`DataError` unless ``skip_bad``.
    """
    n = len(paths)
    images = torch.empty((n, 3, size, size), dtype=torch.uint8)
    kept: list[int] = []
    skipped: list[str] = []
    logger.info(
        "decoding %d images from %s at %dx%d (%.2f GB in memory)", n, source, size, size, images.numel() / 1e9
    )
    executor = ThreadPoolExecutor(
        max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="fedderm-decode"
    )
    try:
        for i, result in enumerate(executor.map(_try_read_image, paths, [size] * n)):
            if isinstance(result, DataError):
                if not skip_bad:
                    raise DataError(
                        f"{result} (set skip-bad-files=true to skip unreadable images)"
                    ) from result
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
        raise DataError(f"no readable images in {source} ({len(listing.skipped) + len(skipped)} skipped)")
    idx = np.asarray(kept, dtype=np.int64)
    return ImagePool(
        images=images,
        labels=listing.labels[idx],
        classes=listing.classes,
        sites=None if listing.sites is None else listing.sites[idx],
        site_names=listing.site_names,
        groups=None if listing.groups is None else _renumber(listing.groups[idx]),
        skipped=listing.skipped + skipped,
        splits=None if listing.splits is None else listing.splits[idx],
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
    return np.asarray(
        [codes.setdefault(k if k is not None else (i,), len(codes)) for i, k in enumerate(keys)],
        dtype=np.int64,
    )


def _label_indices(names: Sequence[str], classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Index of each name in ``classes`` (``-1`` if absent) and the mask of absent ones."""
    lookup = {c: i for i, c in enumerate(classes)}
    idx = np.fromiter((lookup.get(n, -1) for n in names), dtype=np.int64, count=len(names))
    return idx, idx < 0


def unknown_classes(found: Sequence[tuple[str, str]], classes: Sequence[str], source: str) -> DataError:
    """One line for images whose class (a folder or a label) the given class list (the run-config
    key ``classes``) lacks, ``found`` holding (class, where: a file or a CSV line) per image: each
    such class once, with its number of images and the first of them, and the listed class the
    data has no images of that is spelled most like it (a typo)."""
    import difflib

    first: dict[str, str] = {}
    counts: dict[str, int] = {}
    for name, where in found:
        first.setdefault(name, where)
        counts[name] = counts.get(name, 0) + 1
    absent = [c for c in classes if c not in counts]  # listed, and the data never names them
    hints = [
        f"{close[0]!r} for {name!r}"
        for name in counts
        if (close := difflib.get_close_matches(name, absent, n=1, cutoff=0.6))
    ]
    extra = ", ".join(
        f"{name!r} ({n} image{'s' if n != 1 else ''}, first {first[name]})"
        for name, n in sorted(counts.items(), key=lambda kv: -kv[1])
    )
    return DataError(
        f"{source}: the data has class(es) {extra} that the run-config key 'classes' does not list "
        f"({','.join(classes)}){'; a typo? ' + ', '.join(hints) if hints else ''}. Fix 'classes', or set "
        "skip-bad-files=true to leave those images out"
    )


def _raise_or_skip(
    problems: list[tuple[str, str]], skip_bad: bool, header: str, prefix: str = ""
) -> list[str]:
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
    raise DataError(f"{header} ({len(problems)}): {listed}{more} (set skip-bad-files=true to skip them)")
