"""The data's own train/val/test split: a CSV ``split`` column and an image folder's
``train/``, ``val/``, ``test/`` folders give ``pool.splits``; with ``test-set="global"`` their test
images are exactly the global test set and no client sees them; with ``per-client`` they are pooled.

Every generated image is one solid colour that names it: red = 10 + 100 × split code (train 0, val 1,
test 2), green = a running number, blue = 40 × class; so a client's tensors say which images it got.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedderm.config import parse_config
from fedderm.data import DataError, load_client_data, testset
from fedderm.data import decode as decode_module
from fedderm.data.pool import SPLIT_NAMES
from fedderm.data.sources import load_csv, load_folder
from fedderm.data.testset import GLOBAL_SPLIT, global_split

CLASSES = ["mel", "nv"]
#: images per (split, class); the split names as written on disk / in the CSV (any case)
COUNTS = {"train": 24, "Val": 6, "TEST": 9}
CODE = {"train": 0, "val": 1, "test": 2}


def _image(path: Path, split: str, number: int, cls: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (10, 12), (10 + 100 * CODE[split.lower()], number, 40 * cls)).save(path)


def make_split_folder(root: Path) -> Path:
    """``root/<split>/<class>/<n>.png`` with the splits of COUNTS."""
    number = 0
    for split, n in COUNTS.items():
        for c, cls in enumerate(CLASSES):
            for _ in range(n):
                _image(root / split / cls / f"{number}.png", split, number, c)
                number += 1
    return root


def make_split_csv(root: Path, split_header: str = "split") -> Path:
    """HAM10000-style metadata with a ``split`` column; every image its own lesion."""
    lines = [f"lesion_id,image_id,dx,{split_header}"]
    number = 0
    for split, n in COUNTS.items():
        for c, cls in enumerate(CLASSES):
            for _ in range(n):
                _image(root / "images" / f"ISIC_{number:05d}.png", split, number, c)
                lines.append(f"HAM_{number:05d},ISIC_{number:05d},{cls},{split}")
                number += 1
    meta = root / "metadata.csv"
    meta.write_text("\n".join(lines) + "\n")
    return meta


def _split_of(images: torch.Tensor) -> np.ndarray:
    """The split code each image was written with (its red value)."""
    return (images[:, 0, 0, 0].numpy().astype(np.int64) - 10) // 100


def _numbers(images: torch.Tensor) -> list[int]:
    return sorted(images[:, 1, 0, 0].tolist())


def _cfg(tmp_path: Path, dataset: str, data_path: Path, **extra):
    return parse_config(
        {
            "dataset": dataset,
            "data-path": str(data_path),
            "image-size": 8,
            "partition": "iid",
            "cache-dir": str(tmp_path / "cache"),
            **extra,
        }
    )


def _expected(split: str) -> list[int]:
    """The running numbers of the images written into ``split``."""
    out, number = [], 0
    for name, n in COUNTS.items():
        for _ in CLASSES:
            out += list(range(number, number + n)) if name.lower() == split else []
            number += n
    return out


# --------------------------------------------------------------------------------------
# loaders: pool.splits
# --------------------------------------------------------------------------------------


def test_folder_split_layout_gives_splits_not_sites(tmp_path):
    pool = load_folder(make_split_folder(tmp_path / "data"), 8)
    assert pool.classes == CLASSES and pool.sites is None  # train/val/test are no sites
    assert len(pool) == 2 * sum(COUNTS.values())
    assert pool.splits.tolist() == _split_of(pool.images).tolist()
    assert np.bincount(pool.splits, minlength=3).tolist() == [48, 12, 18]
    # the labels come from the class folders below the split folders
    assert (pool.labels == pool.images[:, 2, 0, 0].numpy() // 40).all()


def test_folder_split_layout_keeps_sites_below_the_splits(tmp_path):
    for split in ("train", "test"):
        for site in ("siteA", "siteB"):
            for c, cls in enumerate(CLASSES):
                _image(tmp_path / split / site / cls / "x.png", split, 0, c)
    pool = load_folder(tmp_path, 8)
    assert pool.site_names == ["siteA", "siteB"] and pool.classes == CLASSES
    assert pool.splits.tolist() == [2, 2, 2, 2, 0, 0, 0, 0]  # split folders in sorted order
    assert pool.sites.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]


def test_folder_without_split_folders_has_no_splits(tmp_path):
    for c, cls in enumerate(CLASSES):
        _image(tmp_path / cls / "a.png", "train", 0, c)
    assert load_folder(tmp_path, 8).splits is None


def test_split_folder_with_loose_images_is_refused(tmp_path):
    make_split_folder(tmp_path)
    _image(tmp_path / "TEST" / "loose.png", "test", 0, 0)
    with pytest.raises(DataError, match=r"TEST holds image files directly.*TEST/<class>/<image>"):
        load_folder(tmp_path, 8)


def test_csv_split_column_any_case(tmp_path):
    pool = load_csv(make_split_csv(tmp_path, split_header="Split"), 8)
    assert pool.classes == CLASSES  # HAM layout: the dx values, not the split column
    assert pool.splits.tolist() == _split_of(pool.images).tolist()
    assert np.bincount(pool.splits, minlength=3).tolist() == [48, 12, 18]


def test_isic_csv_split_column_is_no_class_column(tmp_path):
    lines = ["image,MEL,NV,split"]
    rows = [("MEL", "train"), ("NV", "train"), ("MEL", "test"), ("NV", "Validation")]
    for i, (cls, split) in enumerate(rows):
        _image(tmp_path / f"ISIC_{i}.png", "train", i, 0)
        lines.append(f"ISIC_{i},{1.0 if cls == 'MEL' else 0.0},{1.0 if cls == 'NV' else 0.0},{split}")
    (tmp_path / "gt.csv").write_text("\n".join(lines) + "\n")
    pool = load_csv(tmp_path / "gt.csv", 8)
    assert pool.classes == ["MEL", "NV"] and pool.labels.tolist() == [0, 1, 0, 1]
    assert [SPLIT_NAMES[s] for s in pool.splits] == ["train", "train", "test", "val"]


def test_csv_bad_split_value_names_line_and_value(tmp_path):
    meta = make_split_csv(tmp_path)
    lines = meta.read_text().splitlines()
    lines[3] = lines[3].rsplit(",", 1)[0] + ",holdout"
    meta.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"line 4 \(image 'ISIC_00002'\): 'split' is 'holdout', expected"):
        load_csv(meta, 8)
    pool = load_csv(meta, 8, skip_bad_files=True)
    assert len(pool) == 2 * sum(COUNTS.values()) - 1 and len(pool.skipped) == 1


def test_cache_keeps_splits(tmp_path, monkeypatch):
    data = make_split_folder(tmp_path / "data")
    first = load_folder(data, 8, cache_dir=tmp_path / "cache")

    def _fail(*_):
        raise AssertionError("decoder called although the cache should have been used")

    monkeypatch.setattr(decode_module, "_read_image", _fail)
    again = load_folder(data, 8, cache_dir=tmp_path / "cache")
    assert again.splits.tolist() == first.splits.tolist()


# --------------------------------------------------------------------------------------
# test-set = "global" / "per-client"
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["folder", "csv"])
def test_global_test_set_is_exactly_the_data_test_split_and_never_trained_on(tmp_path, dataset):
    path = make_split_folder(tmp_path / "d") if dataset == "folder" else make_split_csv(tmp_path / "d")
    cfg = _cfg(tmp_path, dataset, path, **{"test-set": "global"})
    clients = [load_client_data(cfg, p, 2) for p in range(2)]
    held = global_split(clients[0].pool, cfg)
    assert held.source == {"folder": "test/ folder", "csv": "CSV split column"}[dataset]
    # the global test set: exactly the images marked test, the same at every client
    for c in clients:
        images, labels = c.tensors(GLOBAL_SPLIT)
        assert _numbers(images) == _expected("test") and set(_split_of(images)) == {2}
        assert labels.tolist() == (images[:, 2, 0, 0] // 40).tolist()
    # no client trains, validates or tests on a test image; together they hold every other image
    seen = []
    for c in clients:
        for which in ("train", "labelled", "val", "test"):
            images, _ = c.tensors(which)
            assert 2 not in set(_split_of(images).tolist()), (c.partition_id, which)
        for which in ("train", "val", "test"):
            seen += _numbers(c.tensors(which)[0])
    assert sorted(seen) == sorted(_expected("train") + _expected("val"))
    # the data's val images are the clients' validation images (each client its share of them)
    vals = sorted(n for c in clients for n in _numbers(c.tensors("val")[0]))
    assert vals == _expected("val")


@pytest.mark.parametrize("dataset", ["folder", "csv"])
def test_per_client_pools_the_data_splits(tmp_path, dataset):
    path = make_split_folder(tmp_path / "d") if dataset == "folder" else make_split_csv(tmp_path / "d")
    cfg = _cfg(tmp_path, dataset, path)
    assert cfg.test_set == "per-client"
    clients = [load_client_data(cfg, p, 2) for p in range(2)]
    seen = [n for c in clients for which in ("train", "val", "test") for n in _numbers(c.tensors(which)[0])]
    assert sorted(seen) == list(range(2 * sum(COUNTS.values())))  # every image, test/ included, dealt out
    assert all(c.global_test is None for c in clients)


def test_test_data_path_folder_uses_only_its_test_folder(tmp_path):
    train = tmp_path / "train-data"
    for c, cls in enumerate(CLASSES):
        for i in range(20):
            _image(train / cls / f"{i}.png", "train", i, c)
    other = make_split_folder(tmp_path / "other")
    cfg = _cfg(tmp_path, "folder", train, **{"test-set": "global", "test-data-path": str(other)})
    pool = load_folder(train, 8)
    test, idx = testset.test_pool(pool, cfg, lambda p, classes: load_folder(p, 8, classes=classes))
    assert _numbers(test.images[torch.from_numpy(idx)]) == _expected("test")
