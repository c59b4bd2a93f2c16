"""Data checks before training: each bad data set stops ``sim.py`` before
Ray starts, with a non-zero exit code and one line naming the client or the file/folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import registry
import sim
from fedderm.data import DataError, check_federation
from fedderm.data.checks import check_pool, check_union
from fedderm.data.pool import ImagePool

ROOT = Path(__file__).resolve().parents[1]


def _folder(root: Path, counts: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


# name -> (class folders and their image counts, what the one error line must contain)
BAD = {
    "one class": ({"nevus": 20}, ["has 1 class ('nevus', 20 images)", "at least 2"]),
    "empty class": (
        {"nevus": 20, "melanoma": 20, "bcc": 0},
        ["class 'bcc' has 0 images", "/bcc", "40 images in 3 classes"],
    ),
    "rare typo class": (
        {"nevus": 20, "melanoma": 20, "melanomaa": 1},
        ["class 'melanomaa' has only 1 image", "/melanomaa", "largest has 20", "run-config key 'classes'"],
    ),
    "too few samples": (
        {"nevus": 2, "melanoma": 2},
        ["error: client ", "has only", "too few", "partition='iid' of 4 images in", "test 0"],
    ),
    "more clients than images": (
        {"nevus": 1, "melanoma": 1},
        ["error: client 2 has no images: 3 clients cannot share the 2 images of", "/data", "fewer clients"],
    ),
}


def _overrides(data: Path, tmp_path: Path) -> dict:
    return {
        "dataset": "folder",
        "data-path": str(data),
        "image-size": 8,
        "model": "tiny-cnn",
        "num-server-rounds": 1,
        "local-epochs": 1,
        "output-dir": str(tmp_path / "out"),
        "cache-dir": str(tmp_path / "cache"),
        "partition": "iid",
        "min-clients": 3,
    }


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_data_stops_sim_before_ray_with_one_line(case, tmp_path, capfd):
    counts, expected = BAD[case]
    data = _folder(tmp_path / "data", counts)
    overrides = _overrides(data, tmp_path)
    args = [
        "--num-supernodes",
        "3",
        "--run-config",
        " ".join(
            f"{k}={v!r}".replace("'", '"') if isinstance(v, str) else f"{k}={v}" for k, v in overrides.items()
        ),
    ]
    code = sim.main(args)
    out, err = capfd.readouterr()
    assert code != 0
    lines = [line for line in (out + err).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, lines
    for part in expected:
        assert part in errors[0], (part, errors[0])
    assert "Traceback" not in out + err
    assert not (tmp_path / "out").exists()  # no run folder: the ServerApp never started


def test_bad_data_exit_code_and_console_in_a_subprocess(tmp_path):
    """The real command line: exit 1, one line naming the client, no traceback, no Ray."""
    data = _folder(tmp_path / "data", {"nevus": 2, "melanoma": 2})
    overrides = _overrides(data, tmp_path)
    config = " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in overrides.items())
    proc = subprocess.run(
        [sys.executable, "sim.py", "--num-supernodes", "3", "--run-config", config],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console
    assert "Traceback" not in console and "ray" not in console.lower()
    assert [line for line in console.splitlines() if "error" in line.lower()] == [
        line for line in console.splitlines() if line.startswith("error: client ")
    ]


def test_sift_class_texts_are_checked_before_the_simulation(tmp_path, capfd):
    data = _folder(tmp_path / "data", {"nevus": 12, "melanoma": 12})
    texts = tmp_path / "texts.txt"
    texts.write_text("a benign mole\n")
    overrides = {**_overrides(data, tmp_path), "method": "sift", "sift.class-texts": str(texts)}
    with pytest.raises(ValueError, match=r"sift.class-texts.*texts.txt has 1 class texts but there are 2"):
        sim.check_data(sim.resolved_run_config(overrides), 2)


def _pool(counts: list[int], classes: list[str]) -> ImagePool:
    labels = np.repeat(np.arange(len(counts)), counts)
    return ImagePool(
        images=torch.zeros((len(labels), 3, 4, 4), dtype=torch.uint8), labels=labels, classes=classes
    )


def test_pool_checks_respect_classes_and_isic_unk():
    # a rare class is fine when 'classes' lists it; ISIC 2019's UNK may be empty (warning)
    assert (
        check_pool(_pool([50, 2], ["nv", "df"]), dataset="npz", data_path="x.npz", classes_given=True) == []
    )
    warnings = check_pool(
        _pool([50, 40, 0], ["NV", "MEL", "UNK"]), dataset="npz", data_path="x.npz", classes_given=True
    )
    assert len(warnings) == 1 and "'UNK' has no images" in warnings[0]
    # a hospital's own data may lack a listed class; the union over clients may not
    check_pool(
        _pool([50, 0], ["nv", "df"]), dataset="folder", data_path="/h", classes_given=True, whole=False
    )
    check_union({"client 0": [50, 0], "client 1": [30, 3]}, ["nv", "df"])
    with pytest.raises(DataError, match=r"class 'df' has 0 images at every client \(client 0, client 1"):
        check_union({"client 0": [50, 0], "client 1": [30, 0]}, ["nv", "df"])
    # with classes inferred, an empty class is an error even at one hospital
    with pytest.raises(DataError, match="client 1: class 'df' has 0 images"):
        check_pool(
            _pool([50, 0], ["nv", "df"]),
            dataset="folder",
            data_path="/h",
            classes_given=False,
            whole=False,
            who="client 1: ",
        )


def test_good_data_passes_every_check(tmp_path):
    data = _folder(tmp_path / "data", {"nevus": 15, "melanoma": 15})
    cfg = registry.load_config(_overrides(data, tmp_path))
    clients = check_federation(cfg, 3)
    assert [c.partition_id for c in clients] == [0, 1, 2]
    assert all(len(c.split.val) and len(c.split.test) for c in clients)
