"""MedMNIST ``.npz`` archives (:func:`load_npz`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedderm.data.cache import _cache_key, _cached, _fingerprint
from fedderm.data.decode import _check_classes, _check_image_size, _existing_path, _raise_or_skip
from fedderm.data.names import medmnist_names
from fedderm.data.pool import SPLIT_NAMES, DataError, ImagePool

logger = logging.getLogger("fedderm.data")

#: MedMNIST split names, pooled in this order (``pool.splits`` codes, :data:`~fedderm.data.pool.SPLIT_NAMES`).
NPZ_SPLITS = SPLIT_NAMES
_NPZ_CHUNK = 256  # images resized per interpolate call


def load_npz(
    path: str | Path,
    image_size: int,
    *,
    skip_bad_files: bool = False,
    cache_dir: str | Path | None = None,
    classes: Sequence[str] | None = None,
) -> ImagePool:
    """Load a MedMNIST ``.npz``: the train, val and test splits pooled in that order (``pool.splits``
    says which split each image came from).

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
    key = _cache_key("npz", path, image_size, skip_bad_files, wanted, files=_fingerprint([path], path.parent))
    pool = _cached(cache_dir, key, lambda: _build_npz(path, image_size, wanted, skip_bad_files))
    return _medmnist_named(pool, path) if wanted is None else pool


def _medmnist_named(pool: ImagePool, path: Path) -> ImagePool:
    """``pool`` with MedMNIST's class names when ``path`` is named after a MedMNIST data set
    (``dermamnist.npz`` -> ``"actinic keratoses and intraepithelial carcinoma", ...``)."""
    names = medmnist_names(path)
    if names is None or len(pool.classes) > len(names):
        return pool
    logger.info("%s: MedMNIST class names %s", path.name, names[: len(pool.classes)])
    return dataclasses.replace(pool, classes=names[: len(pool.classes)])


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
        for i in np.flatnonzero(bad[offset : offset + len(lab)]):
            problems.append(
                (
                    f"{path}: {split}_labels[{i}]",
                    f"label {int(lab[i])} is outside 0..{len(classes) - 1} (classes {classes})",
                )
            )
        offset += len(lab)
    skipped = _raise_or_skip(problems, skip_bad, f"labels out of range in {path}")
    keep = np.flatnonzero(~bad)
    if keep.size == 0:
        raise DataError(f"no usable samples in {path} ({len(skipped)} skipped)")
    logger.info("resizing %d images from %s to %dx%d", labels.size, path, size, size)
    images = torch.empty((labels.size, 3, size, size), dtype=torch.uint8)
    offset = 0
    for split_images, _ in splits:
        _resize_into(images[offset : offset + len(split_images)], split_images)
        offset += len(split_images)
    if keep.size < labels.size:
        images = images[torch.from_numpy(keep)]
    split_codes = np.concatenate([np.full(len(lab), i, dtype=np.int64) for i, (_, lab) in enumerate(splits)])
    return ImagePool(
        images=images, labels=labels[keep], classes=classes, skipped=skipped, splits=split_codes[keep]
    )


def _read_npz(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(images, labels)`` of each split, checked; images ``(N,H,W)`` or ``(N,H,W,3)``."""
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError, OSError, BadZipFile, EOFError...
        raise DataError(f"not a valid .npz file: {path} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(
            f"not a valid .npz file: {path} (it holds a single array, "
            "expected the MedMNIST keys train_images, train_labels, ...)"
        )
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
        raise DataError(f"{path}: {key!r} must have shape (N, H, W) or (N, H, W, 3), got {images.shape}")
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
        raise DataError(
            f"{path}: {key!r} has shape {labels.shape}: multi-label files "
            "(e.g. ChestMNIST) are not supported; expected one integer label per image"
        )
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
        chunk = batch[start : start + _NPZ_CHUNK]
        if (new_h, new_w) != (h, w):
            chunk = F.interpolate(
                chunk.float(), size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True
            )
            chunk = chunk.round_().clamp_(0, 255).to(torch.uint8)
        out[start : start + len(chunk)] = chunk[:, :, top : top + size, left : left + size]
