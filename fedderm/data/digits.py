"""Real images without a download: scikit-learn's bundled handwritten digits (1,797 images of 8×8
pixels, 10 classes, UCI "Optical Recognition of Handwritten Digits").

``dataset="digits"`` loads them as an :class:`~fedderm.data.pool.ImagePool` (upscaled to
``image-size``, grey replicated to RGB), the data of the ``--quick`` grids: unlike the synthetic set,
a classifier must learn real shapes to leave chance.  With ``partition="source"`` each site gets a
stratified share of the digits in its own colour cast (the sites differ in appearance, as 000's and
004's centres do).  :func:`write_digits_npz` writes the same images as a MedMNIST-style ``.npz``
(``train_*``, ``val_*``, ``test_*``) for tests of the ``npz`` loader.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .pool import ImagePool

CLASSES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digits_arrays(image_size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images N×S×S, int64 labels N) of scikit-learn's bundled digits, bilinearly resized."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = (x[:, 0].clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return images, d.target.astype(np.int64)


def deal_out(labels: np.ndarray, sites: int, rng: np.random.Generator) -> np.ndarray:
    """The site of every image: each class's images in a random order, dealt out in turn, so
    that a class's counts at two sites differ by at most one."""
    site = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        site[idx] = np.arange(len(idx)) % sites
    return site


def load_digits_pool(image_size: int, sites: int = 0, seed: int = 0) -> ImagePool:
    """The digits as a pool; ``sites`` > 0 deals each class out evenly (seeded) to that many sites,
    each with its own colour cast (a per-channel gain in [0.6, 1])."""
    images, labels = digits_arrays(image_size)
    rgb = torch.from_numpy(images)[:, None].repeat(1, 3, 1, 1)
    if sites <= 0:
        return ImagePool(images=rgb.contiguous(), labels=labels, classes=CLASSES)
    rng = np.random.default_rng(seed)
    site = deal_out(labels, sites, rng)
    gains = torch.from_numpy(rng.uniform(0.6, 1.0, size=(sites, 3)).astype(np.float32))
    tinted = (rgb.float() * gains[torch.from_numpy(site)][:, :, None, None]).round().to(torch.uint8)
    return ImagePool(
        images=tinted.contiguous(),
        labels=labels,
        classes=CLASSES,
        sites=site,
        site_names=[f"site{s}" for s in range(sites)],
    )


def write_digits_npz(path: str | Path, image_size: int = 28, seed: int = 0) -> Path:
    """Write the digits as a MedMNIST-style ``.npz`` (70/10/20 % train/val/test, seeded shuffle)."""
    images, labels = digits_arrays(image_size)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = np.split(order, [int(0.7 * len(order)), int(0.8 * len(order))])
    arrays = {}
    for name, idx in zip(("train", "val", "test"), cut):
        arrays[f"{name}_images"] = images[idx]
        arrays[f"{name}_labels"] = labels[idx][:, None]
    path = Path(path)
    np.savez_compressed(path, **arrays)
    return path
