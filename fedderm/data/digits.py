"""scikit-learn's bundled handwritten digits as a MedMNIST-style ``.npz``: real images for the quick
scale, with nothing to download (``dataset="digits"``; tests; ``python -m fedderm.data.digits OUT.npz``).

1,797 grayscale 8×8 images of 10 classes (UCI "Optical Recognition of Handwritten Digits", shipped
inside scikit-learn), intensities 0…16 scaled to 0…255, split 70/10/20 % into ``train``/``val``/``test``
stratified by class with a fixed seed, as MedMNIST ships its splits.  :func:`load_npz` resizes them
to ``image-size`` like any npz.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from .npz import load_npz
from .pool import ImagePool

#: file name under ``cache-dir`` (the version changes when the written arrays would)
FILE_NAME = "sklearn-digits-v1.npz"
CLASSES = [str(d) for d in range(10)]


def digits_arrays() -> dict[str, np.ndarray]:
    """The MedMNIST keys (``train_images`` ``(N, 8, 8)`` uint8, ``train_labels`` ``(N, 1)``, val, test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    images = (d.images / 16.0 * 255).round().astype(np.uint8)
    labels = d.target.astype(np.int64)
    idx = np.arange(len(labels))
    rest, test = train_test_split(idx, test_size=0.2, stratify=labels, random_state=0)
    train, val = train_test_split(rest, test_size=0.125, stratify=labels[rest], random_state=0)
    out = {}
    for split, part in (("train", train), ("val", val), ("test", test)):
        part = np.sort(part)
        out[f"{split}_images"], out[f"{split}_labels"] = images[part], labels[part, None]
    return out


def write_digits_npz(path: str | Path) -> Path:
    """Write :func:`digits_arrays` to ``path`` (atomically); returns the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
    np.savez_compressed(tmp, **digits_arrays())
    os.replace(tmp, path)
    return path


def load_digits_pool(image_size: int, cache_dir: str | Path | None = None) -> ImagePool:
    """The digits at ``image_size`` (the npz written once under ``cache_dir``), with its
    ``train``/``val``/``test`` splits (``test-set="global"`` uses ``test``)."""
    folder = Path(cache_dir).expanduser() if cache_dir is not None else Path.home() / ".cache" / "fedderm"
    path = folder / FILE_NAME
    if not path.exists():
        write_digits_npz(path)
    return load_npz(path, image_size, cache_dir=cache_dir, classes=CLASSES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fedderm.data.digits",
        description="Write scikit-learn's bundled digits as a MedMNIST-style .npz (dataset='npz').",
    )
    parser.add_argument("path", help="the .npz file to write")
    args = parser.parse_args(argv)
    path = write_digits_npz(args.path)
    sizes = {k: len(v) for k, v in np.load(path).items() if k.endswith("_labels")}
    print(f"wrote {path}: {sizes}")


if __name__ == "__main__":
    main()
