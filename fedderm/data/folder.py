"""Image folders: ``root/<class>/<image>`` (torchvision ``ImageFolder``) or
``root/<site>/<class>/<image>``, either also under ``root/train|val|test/`` (:func:`load_folder`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedderm.data.cache import _cache_key, _cached, _fingerprint
from fedderm.data.decode import (
    _check_classes,
    _check_image_size,
    _decode_listing,
    _existing_path,
    _has_ext,
    _label_indices,
    _Listing,
    _raise_or_skip,
    _split_code,
    _subdirs,
    _visible,
    _walk_images,
    unknown_classes,
)
from fedderm.data.pool import DataError, ImagePool

#: Image files read by :func:`load_folder` (compared case-insensitively).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff")


def load_folder(
    root: str | Path,
    image_size: int,
    *,
    skip_bad_files: bool = False,
    cache_dir: str | Path | None = None,
    classes: Sequence[str] | None = None,
) -> ImagePool:
    """Load ``root/<class>/<image>`` or ``root/<site>/<class>/<image>``, either possibly split by
    the data itself into ``root/train/...``, ``root/val/...`` and ``root/test/...``.

    The split layout is chosen when every top-level folder is named after a split
    (:data:`~fedderm.data.decode.SPLIT_ALIASES`, any case: ``train``, ``val``/``valid``/``validation``,
    ``test``); ``pool.splits`` then says which split each image came from, and the layout below is
    read from the split folders' sub-folders. The site layout is chosen when every (such) folder
    holds at least one folder and no image file directly; site names are then those folders and
    classes the sorted union of the class folder names. Images are searched recursively under each
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
    key = _cache_key("folder", root, image_size, skip_bad_files, wanted, files=_fingerprint(scan.paths, root))

    def build() -> ImagePool:
        listing = _folder_listing(scan, wanted, skip_bad_files)
        return _decode_listing(listing, image_size, skip_bad_files, source=root)

    return _cached(cache_dir, key, build)


@dataclass
class _FolderScan:
    paths: list[Path]
    class_of: list[str]  # class folder name of each path
    site_of: list[str] | None  # site folder name of each path (site layout only)
    class_names: list[str]  # every class folder name, sorted
    site_names: list[str] | None  # every site folder name, sorted (site layout only)
    split_of: list[int] | None = None  # split code of each path (split layout only)


def _is_site_dir(folder: Path) -> bool:
    """A site folder holds class folders and no image file directly."""
    entries = [p for p in folder.iterdir() if _visible(p.name)]
    has_dirs = any(p.is_dir() for p in entries)
    has_images = any(p.is_file() and _has_ext(p.name, IMAGE_EXTENSIONS) for p in entries)
    return has_dirs and not has_images


def _scan_folder(root: Path) -> _FolderScan:
    top = _subdirs(root)
    if not top:
        raise DataError(
            f"no class folders in {root}: expected root/<class>/<image> or root/<site>/<class>/<image>"
        )
    codes = [_split_code(d.name) for d in top]
    if all(c is not None for c in codes):  # root/<split>/...: the data's own train/val/test
        for d in top:
            loose = [p for p in d.iterdir() if _visible(p.name) and _has_ext(p.name, IMAGE_EXTENSIONS)]
            if any(p.is_file() for p in loose):
                raise DataError(
                    f"{d} holds image files directly; a split folder holds class "
                    f"folders: {d}/<class>/<image> or {d}/<site>/<class>/<image>"
                )
        parts: list[tuple[int | None, list[Path]]] = [(c, _subdirs(d)) for c, d in zip(codes, top)]
    else:
        parts = [(None, top)]
    below = [d for _, dirs in parts for d in dirs]
    if not below:
        raise DataError(
            f"no class folders in the split folders of {root}: expected "
            "root/<split>/<class>/<image> or root/<split>/<site>/<class>/<image>"
        )
    sites = all(_is_site_dir(d) for d in below)
    class_dirs = [
        (split, d.name if sites else None, cls)
        for split, dirs in parts
        for d in dirs
        for cls in (_subdirs(d) if sites else [d])
    ]
    site_names = sorted({d.name for d in below}) if sites else None
    paths, class_of, site_of, split_of = [], [], [], []
    for split, site, cls in class_dirs:
        for p in _walk_images(cls, IMAGE_EXTENSIONS):
            paths.append(p)
            class_of.append(cls.name)
            site_of.append(site)
            split_of.append(split)
    if not paths:
        raise DataError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) found in {root}")
    return _FolderScan(
        paths=paths,
        class_of=class_of,
        site_of=None if site_names is None else site_of,
        class_names=sorted({cls.name for _, _, cls in class_dirs}),
        site_names=site_names,
        split_of=None if parts[0][0] is None else split_of,
    )


def _folder_listing(scan: _FolderScan, wanted: list[str] | None, skip_bad: bool) -> _Listing:
    classes = wanted if wanted is not None else scan.class_names
    labels, bad = _label_indices(scan.class_of, classes)
    if bad.any() and not skip_bad:  # each class folder once, not each of its images
        root = scan.paths[int(np.flatnonzero(bad)[0])].parent.parent
        found = [(scan.class_of[i], str(scan.paths[i])) for i in np.flatnonzero(bad)]
        raise unknown_classes(found, classes, f"class folders in {root}")
    problems = [
        (str(scan.paths[i]), f"class folder {scan.class_of[i]!r} is not in the given classes {classes}")
        for i in np.flatnonzero(bad)
    ]
    skipped = _raise_or_skip(problems, skip_bad, "images of a class not in the class list")
    keep = np.flatnonzero(~bad)
    sites = None
    if scan.site_of is not None:
        site_index = {s: i for i, s in enumerate(scan.site_names)}
        sites = np.asarray([site_index[scan.site_of[i]] for i in keep], dtype=np.int64)
    splits = None if scan.split_of is None else np.asarray(scan.split_of, dtype=np.int64)[keep]
    return _Listing(
        paths=[scan.paths[i] for i in keep],
        labels=labels[keep],
        classes=classes,
        sites=sites,
        site_names=scan.site_names or [],
        skipped=skipped,
        splits=splits,
    )
