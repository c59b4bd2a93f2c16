"""In-memory image pool shared by every data source, and the image resizing rule.

An :class:`ImagePool` is what a loader in :mod:`fedderm.data.sources` returns: every
image decoded once, resized to a common square size and stored as one ``uint8``
tensor, plus integer labels and optional site, group and split codes. Splitting a pool
into clients and train/val/test parts is done elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

__all__ = ["SPLIT_NAMES", "DataError", "ImagePool", "resize_square"]

#: The data's own splits, by code: ``ImagePool.splits`` holds indices into this tuple.
SPLIT_NAMES = ("train", "val", "test")

# 16-bit (and 32-bit integer) grayscale modes; ``Image.convert("RGB")`` would clip them.
_WIDE_GRAY_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})


class DataError(ValueError):
    """Bad input data; the message names the file / column / value at fault."""


@dataclass
class ImagePool:
    """Decoded images with their labels and optional site / group codes.

    Attributes:
        images: ``uint8`` tensor ``(N, 3, S, S)``: decoded, resized, square, RGB
            (grayscale replicated to 3 channels).
        labels: ``int64`` array ``(N,)`` of indices into ``classes``.
        classes: class names.
        sites: ``int64`` array ``(N,)`` of indices into ``site_names``, or ``None``
            when the source has no site information.
        site_names: site names (empty when ``sites`` is ``None``).
        groups: ``int64`` array ``(N,)`` of group codes (e.g. HAM10000 ``lesion_id``)
            so that splits never put one group on both sides; ``None`` if absent.
        skipped: files (or CSV rows / array entries) skipped because they were bad;
            only ever non-empty when the loader ran with ``skip_bad_files=True``.
        splits: ``int64`` array ``(N,)`` of indices into :data:`SPLIT_NAMES`: the split the data
            itself puts each image in (MedMNIST's arrays, a CSV ``split`` column, a folder's
            ``train/``, ``val/``, ``test/``); ``None`` when the data has none.  Only
            ``test-set="global"`` reads it (:mod:`fedderm.data.testset`).
    """

    images: torch.Tensor
    labels: np.ndarray
    classes: list[str]
    sites: np.ndarray | None = None
    site_names: list[str] = field(default_factory=list)
    groups: np.ndarray | None = None
    skipped: list[str] = field(default_factory=list)
    splits: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels, dtype=np.int64)
        self.classes = [str(c) for c in self.classes]
        self.site_names = [str(s) for s in self.site_names]
        if self.sites is not None:
            self.sites = np.asarray(self.sites, dtype=np.int64)
        if self.groups is not None:
            self.groups = np.asarray(self.groups, dtype=np.int64)
        if self.splits is not None:
            self.splits = np.asarray(self.splits, dtype=np.int64)
        self._validate()

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, indices: np.ndarray | list[int] | torch.Tensor) -> ImagePool:
        """Return a new pool with the samples at ``indices`` (class / site names kept)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return ImagePool(
            images=self.images[torch.from_numpy(idx)],
            labels=self.labels[idx],
            classes=list(self.classes),
            sites=None if self.sites is None else self.sites[idx],
            site_names=list(self.site_names),
            groups=None if self.groups is None else self.groups[idx],
            skipped=list(self.skipped),
            splits=None if self.splits is None else self.splits[idx],
        )

    def _validate(self) -> None:
        imgs = self.images
        if not isinstance(imgs, torch.Tensor) or imgs.dtype != torch.uint8:
            got = imgs.dtype if isinstance(imgs, torch.Tensor) else type(imgs).__name__
            raise TypeError(f"ImagePool.images must be a uint8 torch.Tensor, got {got}")
        if imgs.ndim != 4 or imgs.shape[1] != 3 or imgs.shape[2] != imgs.shape[3]:
            raise ValueError(f"ImagePool.images must have shape (N, 3, S, S), got {tuple(imgs.shape)}")
        n = imgs.shape[0]
        _check_codes("labels", self.labels, n, len(self.classes))
        if self.sites is not None:
            _check_codes("sites", self.sites, n, len(self.site_names))
        if self.groups is not None and self.groups.shape != (n,):
            raise ValueError(f"ImagePool.groups must have shape ({n},), got {self.groups.shape}")
        if self.splits is not None:
            _check_codes("splits", self.splits, n, len(SPLIT_NAMES))


def _check_codes(name: str, codes: np.ndarray, n: int, num_names: int) -> None:
    if codes.shape != (n,):
        raise ValueError(f"ImagePool.{name} must have shape ({n},), got {codes.shape}")
    if n and (codes.min() < 0 or codes.max() >= num_names):
        raise ValueError(
            f"ImagePool.{name} must lie in [0, {num_names}), got values in [{codes.min()}, {codes.max()}]"
        )


def resize_square(img: Image.Image, size: int) -> np.ndarray:
    """Convert ``img`` to RGB, resize its shorter edge to ``size`` and center-crop.

    Resizing is bilinear with Pillow's built-in antialiasing when shrinking. 16-bit
    grayscale images are scaled to 8 bit (``value / 257``) rather than clipped.

    Args:
        img: any Pillow image (it is loaded here if it was only opened).
        size: side of the square output, in pixels.

    Returns:
        ``uint8`` array of shape ``(size, size, 3)``.
    """
    if size < 1:
        raise ValueError(f"size must be a positive integer, got {size}")
    img = _to_rgb(img)
    w, h = img.size
    scale = size / min(w, h)
    new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    img = img.crop((left, top, left + size, top + size))
    return np.array(img, dtype=np.uint8)  # a writable copy


def _to_rgb(img: Image.Image) -> Image.Image:
    """Return an 8-bit RGB version of ``img``."""
    if img.mode == "RGB":
        return img
    if img.mode in _WIDE_GRAY_MODES:
        wide = np.asarray(img, dtype=np.float64)
        gray = np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8)
        img = Image.fromarray(gray)
    return img.convert("RGB")
