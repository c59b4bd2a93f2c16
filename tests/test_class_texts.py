"""Class names and SiFT class texts: known label sets get their real names,
``sift.class-texts`` files are checked, the 002 configs ship the papers' class texts."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

import registry
from fedderm.config import ConfigError
from fedderm.data.names import MEDMNIST_LABELS, medmnist_names, readable_names
from fedderm.data.sources import load_npz
from fedderm.sift import class_texts

ROOT = Path(__file__).resolve().parents[1]
HAM_CODES = ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]


def _npz(path: Path, classes: int = 7, n: int = 14) -> Path:
    rng = np.random.default_rng(0)
    arrays = {}
    for split in ("train", "val", "test"):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 8, 8), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % classes).reshape(-1, 1).astype(np.uint8)
    np.savez(path, **arrays)
    return path


def test_medmnist_npz_gets_its_class_names_by_file_name(tmp_path):
    derma = load_npz(_npz(tmp_path / "dermamnist.npz"), 8)
    assert derma.classes == list(MEDMNIST_LABELS["dermamnist"])
    assert derma.classes[4] == "melanoma" and derma.classes[5] == "melanocytic nevi"
    assert load_npz(_npz(tmp_path / "bloodmnist_64.npz", classes=8), 8).classes[7] == "platelet"  # MedMNIST+
    assert load_npz(_npz(tmp_path / "digits.npz"), 8).classes == [str(i) for i in range(7)]
    # an explicit class list wins
    assert load_npz(tmp_path / "dermamnist.npz", 8, classes=HAM_CODES).classes == HAM_CODES
    assert medmnist_names("/x/OrganCMNIST.npz")[0] == "bladder" and medmnist_names("chestmnist.npz") is None


def test_diagnosis_codes_are_spelled_out():
    assert readable_names(["akiec", "MEL", "nv", "SCC", "basal_cell_carcinoma"]) == [
        "actinic keratosis or intraepithelial carcinoma",
        "melanoma",
        "melanocytic nevus",
        "squamous cell carcinoma",
        "basal cell carcinoma",
    ]
    assert class_texts("", ["bkl", "df", "vasc"]) == ["benign keratosis", "dermatofibroma", "vascular lesion"]


def test_class_texts_file_errors_name_the_key_and_file(tmp_path):
    short = tmp_path / "texts.txt"
    short.write_text("# a comment\nmelanoma\nnevus\n")
    assert class_texts(str(short), ["mel", "nv"]) == ["melanoma", "nevus"]
    with pytest.raises(ConfigError) as err:
        class_texts(str(short), ["mel", "nv", "bcc"])
    assert "sift.class-texts" in str(err.value) and str(short) in str(err.value)
    assert "2 class texts but there are 3 classes" in str(err.value)
    with pytest.raises(ConfigError, match=r"sift.class-texts.*'missing/texts.txt' not found"):
        class_texts("missing/texts.txt", ["mel", "nv"])


def test_relative_texts_file_is_found_in_the_app_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    texts = class_texts("configs/texts/organcmnist.txt", list(MEDMNIST_LABELS["organcmnist"]))
    assert texts == list(MEDMNIST_LABELS["organcmnist"])


@pytest.mark.parametrize("config", ["002-sift-tables-1-2.toml", "002-sift-fig4.toml"])
def test_002_sweeps_name_one_text_per_class(config):
    """Every data set of the 002 sweeps names its texts file, with one text per class."""
    grid = tomllib.loads((ROOT / "sweeps" / config).read_text())
    rows = grid["sweep"]["axes"]["data"]
    assert rows and all("sift.class-texts" in row for row in rows)
    for row in rows:
        path = row["data-path"]
        classes = medmnist_names(path) if row["dataset"] == "npz" else HAM_CODES
        assert len(class_texts(row["sift.class-texts"], classes)) == len(classes)


def test_digit_shape_texts_and_their_shuffled_control():
    """sweeps/claims/002-sift-head.toml: one shape text per digit class, and the control deals the same
    ten texts to the wrong classes (every class gets another class's text)."""
    from fedderm.data.digits import CLASSES

    shapes = class_texts("configs/texts/digits-shapes.txt", CLASSES)
    shuffled = class_texts("configs/texts/digits-shapes-shuffled.txt", CLASSES)
    assert len(shapes) == len(set(shapes)) == 10 and sorted(shuffled) == sorted(shapes)
    assert all(a != b for a, b in zip(shapes, shuffled))


def test_sift_head_for_names_differs_from_digit_codes_and_the_texts_are_logged(tmp_path, caplog, monkeypatch):
    """The same images as ``digits.npz`` and as ``dermamnist.npz``: the frozen head W of SiFT is
    built from "0" … "6" in the first case, from DermaMNIST's class names in the second."""
    from strategies.sift import head_embeddings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = registry.load_config({"method": "sift", "cache-dir": str(tmp_path / "cache")})
    digits = load_npz(_npz(tmp_path / "digits.npz"), 8).classes
    names = load_npz(_npz(tmp_path / "dermamnist.npz"), 8).classes
    with caplog.at_level(logging.INFO, logger="flwr"):  # Flower's logger propagates to the root
        w_digits = head_embeddings(cfg, digits)
        w_names = head_embeddings(cfg, names)
    assert w_digits.shape == w_names.shape == (7, 384)
    cos = torch.nn.functional.cosine_similarity(w_digits, w_names, dim=1)
    assert cos.max() < 0.9  # each class's text embedding changed
    logged = [r.getMessage() for r in caplog.records if "class texts" in r.getMessage()]
    assert len(logged) == 2
    assert "0; 1; 2; 3; 4; 5; 6" in logged[0]
    assert "melanoma; melanocytic nevi; vascular lesions" in logged[1]
