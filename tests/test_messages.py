"""What a user reads when something small is off: a typo in ``classes`` is one line naming the class
once (not one clause per image), and every command's ``--help`` is plain text (no
reStructuredText markup from the docstrings it is made of)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from fedderm.data import DataError
from fedderm.data.folder import load_folder
from fedderm.data.tables import load_csv

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CLASSES = ("akiec", "bcc", "vasc")


def _images(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in names:
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / name)


def test_a_class_list_typo_in_a_folder_data_set_is_one_line_naming_the_class_once(tmp_path):
    for c in CLASSES:
        _images(tmp_path / "derm" / c, [f"{c}{i}.png" for i in range(12)])
    with pytest.raises(DataError) as err:
        load_folder(tmp_path / "derm", 16, classes=["akiec", "bcc", "vsac"])
    text = str(err.value)
    assert "\n" not in text and text.count("'vasc'") == 2 and text.count(".png") == 1, text
    assert "'vasc' (12 images, first " in text and "a typo? 'vsac' for 'vasc'" in text
    assert "skip-bad-files=true" in text
    # skip-bad-files still leaves those images out
    pool = load_folder(tmp_path / "derm", 16, classes=["akiec", "bcc", "vsac"], skip_bad_files=True)
    assert len(pool.labels) == 24


def test_a_class_list_typo_in_a_csv_data_set_is_one_line_naming_the_label_once(tmp_path):
    rows = [(f"ISIC_{c}{i}", c) for c in CLASSES for i in range(10)]
    _images(tmp_path, [f"{image}.jpg" for image, _ in rows])
    csv = tmp_path / "HAM10000_metadata.csv"
    csv.write_text("image_id,dx\n" + "".join(f"{image},{dx}\n" for image, dx in rows))
    with pytest.raises(DataError) as err:
        load_csv(csv, 16, classes=["akiec", "bkl", "vasc"])
    text = str(err.value)
    assert "\n" not in text and text.count("'bcc'") == 1 and text.count("ISIC_") == 1, text
    assert "'bcc' (10 images, first line 12 (image 'ISIC_bcc0'))" in text
    assert "a typo?" not in text  # 'bkl' is not spelled like 'bcc': no guess
    assert str(csv) in text


@pytest.mark.parametrize(
    "command", [["sim.py"], ["-m", "fedderm.check"], ["-m", "fedderm.run"], ["-m", "fedderm.inference"]]
)
def test_help_is_plain_text(command):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(ROOT / command[0]), *command[1:]] if command[0].endswith(".py") else command
    out = subprocess.run(
        [sys.executable, *args, "--help"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for markup in ("``", ":func:`", ":class:`", ":mod:`", ":data:`"):
        assert markup not in out.stdout, out.stdout
