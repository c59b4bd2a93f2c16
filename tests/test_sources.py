"""Tests for fedderm.data.sources / fedderm.data.pool on small generated files in the real layouts."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedderm.data import decode
from fedderm.data.pool import DataError, ImagePool, resize_square
from fedderm.data.sources import load_csv, load_folder, load_npz, load_source

ISIC_CLASSES = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC", "UNK"]
S = 16  # image_size used by most tests


def write_image(path: Path, size=(24, 20), color=(200, 40, 90), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fill = color[0] if mode == "L" else color
    Image.new(mode, size, fill).save(path)
    return path


# --------------------------------------------------------------------------------------
# resize_square / ImagePool
# --------------------------------------------------------------------------------------


def _stripes(width: int, height: int, vertical: bool) -> Image.Image:
    """Three equal red / green / blue bands along the long edge."""
    arr = np.zeros((height, width, 3), np.uint8)
    n = width if vertical else height
    for band in range(3):
        sl = slice(band * n // 3, (band + 1) * n // 3)
        if vertical:
            arr[:, sl, band] = 255
        else:
            arr[sl, :, band] = 255
    return Image.fromarray(arr)


@pytest.mark.parametrize("vertical", [True, False])
def test_resize_square_center_crops_the_long_edge(vertical):
    img = _stripes(30, 10, vertical) if vertical else _stripes(10, 30, vertical)
    out = resize_square(img, 10)  # shorter edge already 10: pure crop of the middle band
    assert out.shape == (10, 10, 3) and out.dtype == np.uint8
    assert (out == [0, 255, 0]).all()


def test_resize_square_resizes_shorter_edge_then_crops():
    out = resize_square(_stripes(120, 40, vertical=True), 20)  # -> 60x20, crop columns 20..39
    assert out.shape == (20, 20, 3)
    inner = out[:, 2:-2].astype(int)
    assert (inner[..., 1] == 255).all() and (inner[..., [0, 2]] == 0).all()
    assert (out[..., 1] > out[..., 0]).all() and (out[..., 1] > out[..., 2]).all()


def test_resize_square_grayscale_and_16bit():
    gray = resize_square(Image.new("L", (8, 12), 77), 4)
    assert gray.shape == (4, 4, 3) and (gray == 77).all()
    wide = Image.fromarray(np.full((6, 6), 65535, np.uint16))
    assert (resize_square(wide, 6) == 255).all()


def test_image_pool_validates_and_subsets():
    pool = ImagePool(
        torch.zeros((3, 3, 4, 4), dtype=torch.uint8),
        np.array([0, 1, 1]),
        ["a", "b"],
        sites=[0, 0, 1],
        site_names=["x", "y"],
        groups=[5, 5, 6],
    )
    assert len(pool) == 3 and pool.labels.dtype == np.int64
    sub = pool.subset([2, 0])
    assert len(sub) == 2 and sub.labels.tolist() == [1, 0] and sub.sites.tolist() == [1, 0]
    with pytest.raises(ValueError, match="labels"):
        ImagePool(torch.zeros((2, 3, 4, 4), dtype=torch.uint8), np.array([0, 2]), ["a", "b"])


# --------------------------------------------------------------------------------------
# Image folders
# --------------------------------------------------------------------------------------


def test_folder_flat_layout(tmp_path):
    root = tmp_path / "BACH"
    write_image(root / "Benign" / "b1.tif", (40, 30), (10, 200, 30))
    write_image(root / "Benign" / "sub" / "b2.PNG", (16, 16), (10, 200, 30))
    write_image(root / "Normal" / "n1.png", (20, 50), (0, 0, 250))
    write_image(root / "Normal" / "n2.bmp", (33, 17), (0, 0, 250), mode="L")
    (root / "Normal" / ".DS_Store").write_bytes(b"junk")
    (root / "Normal" / "notes.txt").write_text("not an image")
    write_image(root / ".hidden" / "x.png")
    write_image(root / "__MACOSX" / "Benign" / "._b1.png")
    (root / "microscopy_ground_truth.csv").write_text("a,b\n")

    pool = load_folder(root, S)
    assert pool.images.shape == (4, 3, S, S) and pool.images.dtype == torch.uint8
    assert pool.classes == ["Benign", "Normal"]
    assert pool.labels.tolist() == [0, 0, 1, 1] and pool.labels.dtype == np.int64
    assert pool.sites is None and pool.site_names == [] and pool.groups is None
    assert (pool.images[0].permute(1, 2, 0) == torch.tensor([10, 200, 30], dtype=torch.uint8)).all()
    assert (pool.images[3] == 0).all()  # grayscale "L" of value 0 replicated to 3 channels


def test_folder_site_layout(tmp_path):
    root = tmp_path / "sites"
    write_image(root / "hospA" / "mel" / "1.jpg")
    write_image(root / "hospA" / "nv" / "2.jpg")
    write_image(root / "hospA" / "nv" / "3.jpeg")
    write_image(root / "hospB" / "nv" / "4.JPG")
    write_image(root / "hospB" / "vasc" / "5.png")
    (root / "hospB" / "README.txt").write_text("site B")

    pool = load_folder(root, S)
    assert len(pool) == 5
    assert pool.classes == ["mel", "nv", "vasc"]
    assert pool.site_names == ["hospA", "hospB"]
    assert pool.labels.tolist() == [0, 1, 1, 1, 2]
    assert pool.sites.tolist() == [0, 0, 0, 1, 1]


def test_folder_class_not_in_given_classes(tmp_path):
    write_image(tmp_path / "a" / "1.png")
    bad = write_image(tmp_path / "zzz" / "2.png")
    with pytest.raises(DataError) as err:
        load_folder(tmp_path, S, classes=["b", "a"])
    assert str(bad) in str(err.value) and "'zzz'" in str(err.value)

    pool = load_folder(tmp_path, S, classes=["b", "a"], skip_bad_files=True)
    assert pool.classes == ["b", "a"] and pool.labels.tolist() == [1]
    assert pool.skipped == [str(bad)]


def test_folder_empty_or_missing(tmp_path):
    with pytest.raises(DataError, match="no class folders"):
        load_folder(tmp_path, S)
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "a.txt").write_text("x")
    with pytest.raises(DataError, match=f"no image files.*{tmp_path}"):
        load_folder(tmp_path, S)
    with pytest.raises(DataError, match="not found: .*nowhere"):
        load_folder(tmp_path / "nowhere", S)


def test_corrupt_image_error_and_skip(tmp_path):
    write_image(tmp_path / "nv" / "good.jpg")
    bad = tmp_path / "nv" / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 this is not a jpeg at all")
    with pytest.raises(DataError) as err:
        load_folder(tmp_path, S)
    assert str(bad) in str(err.value)

    pool = load_folder(tmp_path, S, skip_bad_files=True)
    assert len(pool) == 1 and pool.skipped == [str(bad)]


# --------------------------------------------------------------------------------------
# ISIC 2019 ground truth CSV
# --------------------------------------------------------------------------------------


def make_isic(root: Path, labels: list[str]) -> Path:
    """ISIC_2019_Training_GroundTruth.csv + ISIC_2019_Training_Input/ with JPEGs of varying sizes."""
    lines = ["image," + ",".join(ISIC_CLASSES)]
    for i, label in enumerate(labels):
        image_id = f"ISIC_{i:07d}"
        write_image(root / "ISIC_2019_Training_Input" / f"{image_id}.jpg", (30 + 7 * i, 20 + 3 * i))
        lines.append(image_id + "," + ",".join("1.0" if c == label else "0.0" for c in ISIC_CLASSES))
    (root / "ISIC_2019_Training_Input" / "LICENSE.txt").write_text("CC-BY-NC")
    csv = root / "ISIC_2019_Training_GroundTruth.csv"
    csv.write_text("\n".join(lines) + "\n")
    return csv


def test_isic_csv(tmp_path):
    csv = make_isic(tmp_path, ["NV", "MEL", "SCC", "NV", "VASC"])
    pool = load_csv(csv, S)
    assert pool.images.shape == (5, 3, S, S)
    assert pool.classes == ISIC_CLASSES  # file order, all-zero UNK kept
    assert pool.labels.tolist() == [1, 0, 7, 1, 6]
    assert pool.sites is None and pool.groups is None and pool.skipped == []


def test_isic_csv_bad_one_hot_row(tmp_path):
    csv = make_isic(tmp_path, ["NV", "MEL"])
    text = csv.read_text().replace("ISIC_0000001,1.0", "ISIC_0000001,0.0")  # no 1.0 left
    csv.write_text(text)
    with pytest.raises(DataError) as err:
        load_csv(csv, S)
    msg = str(err.value)
    assert str(csv) in msg and "line 3" in msg and "ISIC_0000001" in msg


def test_isic_csv_missing_image(tmp_path):
    csv = make_isic(tmp_path, ["NV", "MEL", "BCC"])
    (tmp_path / "ISIC_2019_Training_Input" / "ISIC_0000001.jpg").unlink()
    with pytest.raises(DataError) as err:
        load_csv(csv, S)
    msg = str(err.value)
    assert "ISIC_0000001" in msg and str(csv) in msg and str(tmp_path) in msg

    pool = load_csv(csv, S, skip_bad_files=True)
    assert pool.labels.tolist() == [1, 2] and len(pool.skipped) == 1
    assert "ISIC_0000001" in pool.skipped[0]


def test_isic_csv_explicit_image_dir_and_site_column(tmp_path):
    csv = make_isic(tmp_path / "data", ["NV", "MEL"])
    text = csv.read_text().splitlines()
    rows = [text[0] + ",center"] + [r + f",c{i % 2}" for i, r in enumerate(text[1:])]
    moved = tmp_path / "gt.csv"
    moved.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match="site_column"):  # non-numeric 'center' is not a class
        load_csv(moved, S, image_dir=tmp_path / "data")
    pool = load_csv(moved, S, image_dir=tmp_path / "data", site_column="center")
    assert pool.classes == ISIC_CLASSES and pool.site_names == ["c0", "c1"]
    assert pool.sites.tolist() == [0, 1]


# --------------------------------------------------------------------------------------
# HAM10000 metadata
# --------------------------------------------------------------------------------------

HAM_ROWS = [  # lesion_id, image_id, dx, dataset
    ("HAM_0000118", "ISIC_0027419", "bkl", "vidir_modern"),
    ("HAM_0000118", "ISIC_0025030", "bkl", "vidir_modern"),
    ("HAM_0002730", "ISIC_0026769", "nv", "rosendahl"),
    ("HAM_0001466", "ISIC_0031633", "mel", "vienna_dias"),
    ("HAM_0001466", "ISIC_0027850", "mel", "vienna_dias"),
    ("HAM_0002761", "ISIC_0029176", "vasc", "vidir_molemax"),
]


def make_ham(root: Path, rows=HAM_ROWS, with_dataset=True) -> Path:
    """HAM10000_metadata (no extension) + images split over part_1 and part_2."""
    header = "lesion_id,image_id,dx,dx_type,age,sex,localization" + (",dataset" if with_dataset else "")
    lines = [header]
    for i, (lesion, image_id, dx, site) in enumerate(rows):
        part = 1 if i % 2 == 0 else 2
        write_image(root / f"HAM10000_images_part_{part}" / f"{image_id}.jpg", (60, 45))
        lines.append(f"{lesion},{image_id},{dx},histo,80.0,male,scalp" + (f",{site}" if with_dataset else ""))
    meta = root / "HAM10000_metadata"
    meta.write_text("\n".join(lines) + "\n")
    return meta


def test_ham10000_metadata(tmp_path):
    pool = load_csv(make_ham(tmp_path), S)
    assert pool.images.shape == (6, 3, S, S)
    assert pool.classes == ["bkl", "mel", "nv", "vasc"]
    assert pool.labels.tolist() == [0, 0, 2, 1, 1, 3]
    assert pool.site_names == ["rosendahl", "vidir_modern", "vidir_molemax", "vienna_dias"]
    assert [pool.site_names[s] for s in pool.sites] == [r[3] for r in HAM_ROWS]
    g = pool.groups.tolist()
    assert g[0] == g[1] and g[3] == g[4] and len(set(g)) == 4


def test_ham10000_site_column_options(tmp_path):
    meta = make_ham(tmp_path)
    assert load_csv(meta, S, site_column="").sites is None
    with pytest.raises(DataError) as err:
        load_csv(meta, S, site_column="hospital")
    assert "'hospital'" in str(err.value) and str(meta) in str(err.value)
    assert load_csv(make_ham(tmp_path / "old", with_dataset=False), S).sites is None


def test_ham10000_label_outside_given_classes(tmp_path):
    meta = make_ham(tmp_path)
    classes = ["akiec", "bcc", "bkl", "df", "mel", "nv"]  # no 'vasc'
    with pytest.raises(DataError) as err:
        load_csv(meta, S, classes=classes)
    msg = str(err.value)
    assert "'vasc'" in msg and str(meta) in msg and "line 7" in msg and "ISIC_0029176" in msg

    pool = load_csv(meta, S, classes=classes, skip_bad_files=True)
    assert pool.classes == classes and len(pool) == 5 and len(pool.skipped) == 1
    assert pool.labels.tolist() == [2, 2, 5, 4, 4]


def test_csv_without_expected_columns(tmp_path):
    csv = tmp_path / "ISIC_2019_Training_Metadata.csv"
    csv.write_text(
        "image,age_approx,anatom_site_general,lesion_id,sex\nISIC_0000000,55.0,anterior torso,,female\n"
    )
    with pytest.raises(DataError) as err:
        load_csv(csv, S)
    msg = str(err.value)
    assert str(csv) in msg and "anatom_site_general" in msg and "'image_id'" in msg and "'dx'" in msg


# --------------------------------------------------------------------------------------
# MedMNIST .npz
# --------------------------------------------------------------------------------------


def make_npz(path: Path, rgb: bool, n=(5, 2, 3), side=28, **override) -> Path:
    rng = np.random.default_rng(0)
    arrays = {}
    for split, count in zip(("train", "val", "test"), n):
        shape = (count, side, side, 3) if rgb else (count, side, side)
        arrays[f"{split}_images"] = rng.integers(0, 256, shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 4, (count, 1), dtype=np.uint8)
    arrays.update(override)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez_compressed(path, **arrays)
    return path


def test_npz_grayscale(tmp_path):
    path = make_npz(tmp_path / "organcmnist.npz", rgb=False)
    pool = load_npz(path, 32)
    ref = np.load(path)
    labels = np.concatenate([ref[f"{s}_labels"][:, 0] for s in ("train", "val", "test")])
    assert pool.images.shape == (10, 3, 32, 32) and pool.images.dtype == torch.uint8
    assert pool.labels.tolist() == labels.tolist()
    # named after a MedMNIST data set: MedMNIST's class names (labels index them)
    assert pool.classes == ["bladder", "femur-left", "femur-right", "heart"][: labels.max() + 1]
    assert torch.equal(pool.images[:, 0], pool.images[:, 2])  # gray replicated
    assert torch.equal(load_npz(path, 32).images, pool.images)  # deterministic


def test_npz_rgb_same_size_is_exact(tmp_path):
    path = make_npz(tmp_path / "dermamnist.npz", rgb=True)
    pool = load_npz(path, 28, classes=["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"])
    ref = np.load(path)
    images = np.concatenate([ref[f"{s}_images"] for s in ("train", "val", "test")])
    assert pool.images.shape == (10, 3, 28, 28)
    assert np.array_equal(pool.images.permute(0, 2, 3, 1).numpy(), images)
    assert len(pool.classes) == 7 and pool.sites is None and pool.groups is None
    assert load_npz(path, 14).images.shape == (10, 3, 14, 14)


def test_npz_errors(tmp_path):
    path = make_npz(tmp_path / "a.npz", rgb=False, val_labels=None)
    with pytest.raises(DataError, match=f"'val_labels'.*{path}"):
        load_npz(path, S)

    chest = make_npz(tmp_path / "chestmnist.npz", rgb=False, train_labels=np.zeros((5, 14), np.uint8))
    with pytest.raises(DataError, match=f"{chest}.*multi-label"):
        load_npz(chest, S)

    out = make_npz(tmp_path / "b.npz", rgb=False, test_labels=np.array([[0], [1], [9]], np.uint8))
    with pytest.raises(DataError) as err:
        load_npz(out, S, classes=["a", "b", "c", "d"])
    assert str(out) in str(err.value) and "label 9" in str(err.value)
    pool = load_npz(out, S, classes=["a", "b", "c", "d"], skip_bad_files=True)
    assert len(pool) == 9 and pool.skipped == [f"{out}: test_labels[2]"]

    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"definitely not a zip")
    with pytest.raises(DataError, match=f"not a valid .npz file: {junk}"):
        load_npz(junk, S)


# --------------------------------------------------------------------------------------
# Cache and dispatch
# --------------------------------------------------------------------------------------


def _fail(*args, **kwargs):
    raise AssertionError("decoder called although the cache should have been used")


def test_cache_hit_and_invalidation(tmp_path, monkeypatch):
    csv = make_isic(tmp_path / "isic", ["NV", "MEL", "BKL"])
    cache = tmp_path / "cache"
    first = load_csv(csv, S, cache_dir=cache)
    files = list(cache.glob("*.pt"))
    assert len(files) == 1 and not list(cache.glob("*.tmp"))

    monkeypatch.setattr(decode, "_read_image", _fail)
    again = load_csv(csv, S, cache_dir=cache)
    assert torch.equal(again.images, first.images) and again.labels.tolist() == first.labels.tolist()
    assert again.classes == first.classes

    with pytest.raises(AssertionError, match="decoder called"):  # another size: a new entry
        load_csv(csv, S + 1, cache_dir=cache)
    img = tmp_path / "isic" / "ISIC_2019_Training_Input" / "ISIC_0000002.jpg"
    write_image(img, (41, 41), (1, 2, 3))
    st = img.stat()
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="decoder called"):  # changed file: cache miss
        load_csv(csv, S, cache_dir=cache)

    monkeypatch.undo()
    fresh = load_csv(csv, S, cache_dir=cache)
    assert not torch.equal(fresh.images[2], first.images[2])
    assert len(list(cache.glob("*.pt"))) == 2


def test_cache_keeps_sites_groups_and_skipped(tmp_path, monkeypatch):
    meta = make_ham(tmp_path)
    (tmp_path / "HAM10000_images_part_2" / "ISIC_0025030.jpg").write_bytes(b"garbage")
    first = load_csv(meta, S, cache_dir=tmp_path / "c", skip_bad_files=True)
    monkeypatch.setattr(decode, "_read_image", _fail)
    again = load_csv(meta, S, cache_dir=tmp_path / "c", skip_bad_files=True)
    assert len(again) == 5 and again.skipped == first.skipped and len(again.skipped) == 1
    assert again.sites.tolist() == first.sites.tolist() and again.site_names == first.site_names
    assert again.groups.tolist() == first.groups.tolist()


def test_load_source_dispatch(tmp_path):
    write_image(tmp_path / "f" / "a" / "1.png")
    assert len(load_source("folder", tmp_path / "f", S)) == 1
    assert len(load_source("npz", make_npz(tmp_path / "x.npz", rgb=True), S)) == 10
    with pytest.raises(DataError, match="csv, folder, npz"):
        load_source("dicom", tmp_path, S)
    with pytest.raises(DataError, match="not found: .*missing.csv"):
        load_source("csv", tmp_path / "missing.csv", S)
