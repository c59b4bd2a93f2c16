"""``python -m fedderm.inference`` / ``fedderm-predict``: a run's model file and images -> a CSV."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedderm.inference import load_model, main
from fedderm.models import create_model
from fedderm.results import RunRecorder

CLASSES = ["dark", "mid", "bright"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def saved_model(tmp_path):
    """A tiny-cnn model.pt/model-best.pt written as a run writes them (RunRecorder, class names)."""
    run_dir = tmp_path / "fedavg-npz-run"
    recorder = RunRecorder(run_dir, "fedavg", {"method": "fedavg"})
    meta = {"method": "fedavg", "model": "tiny-cnn", "image_size": 16, "network": "classifier"}
    recorder.set_classes(CLASSES, None, meta)
    torch.manual_seed(0)
    state = create_model("tiny-cnn", len(CLASSES), 16).state_dict()
    recorder.save_model(state)
    recorder.save_model(state, "model-best.pt")
    return run_dir


@pytest.fixture
def image_folder(tmp_path):
    """Five images of different sizes and brightness: three at the top, two in a sub-folder."""
    folder = tmp_path / "new-patients"
    (folder / "ward-b").mkdir(parents=True)
    rng = np.random.default_rng(1)
    names = ["a.png", "b.jpg", "c.PNG", "ward-b/d.png", "ward-b/e.jpeg"]
    for i, name in enumerate(names):
        pixels = (rng.integers(0, 60, (20 + 3 * i, 24, 3)) + 45 * i).astype(np.uint8)
        Image.fromarray(pixels).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    return folder, sorted(folder / n for n in names)


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def test_folder_gives_one_row_per_image_with_the_model_probabilities(
    saved_model, image_folder, tmp_path, capsys
):
    folder, files = image_folder
    out = tmp_path / "pred.csv"
    assert main([str(saved_model / "model.pt"), str(folder), "-o", str(out)]) == 0
    rows = read_csv(out)
    assert rows[0] == ["image", "predicted", "probability", "p:dark", "p:mid", "p:bright"]
    assert [Path(r[0]) for r in rows[1:]] == files  # every image once, sorted, the .txt left out
    clf = load_model(saved_model / "model.pt")
    images = [Image.open(f) for f in files]
    expected = clf.probabilities(images).numpy()
    got = np.array([[float(v) for v in r[3:]] for r in rows[1:]])
    np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)
    for row, probs in zip(rows[1:], expected):
        assert row[1] == CLASSES[int(probs.argmax())]
        assert float(row[2]) == pytest.approx(float(probs.max()), abs=1e-6)
    assert f"5 images -> {out}" in capsys.readouterr().err


def test_run_folder_and_files_with_progress(saved_model, image_folder, capsys):
    """The run folder stands for its model-best.pt; single files work; progress for many images."""
    folder, files = image_folder
    assert main([str(saved_model), str(files[0]), str(folder / "ward-b"), "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    rows = list(csv.reader(captured.out.splitlines()))
    assert [Path(r[0]) for r in rows[1:]] == [files[0], *sorted((folder / "ward-b").iterdir())]
    assert "labelled 3/3 images" in captured.err


def _missing(d):
    return d / "missing.pt"


def _text(d):
    (d / "notes.pt").write_text("hello")
    return d / "notes.pt"


def _plain(d):
    torch.save({"w": torch.zeros(2)}, d / "plain.pt")
    return d / "plain.pt"


def _json(d):  # a run folder's summary.json
    (d / "summary.json").write_text('{"status": "done"}')
    return d / "summary.json"


def _checkpoint(d):
    torch.save({"stage": "train", "round": 8, "arrays": {"w": torch.zeros(2)}}, d / "checkpoint-round-8.pt")
    return d / "checkpoint-round-8.pt"


def _renamed_checkpoint(d):
    torch.save({"stage": "train", "round": 8, "arrays": {"w": torch.zeros(2)}}, d / "saved.pt")
    return d / "saved.pt"


def _other_model(d):
    """Run metadata that names another network than the weights it holds."""
    recorder = RunRecorder(d / "run", "fedavg", {})
    recorder.set_classes(CLASSES, None, {"model": "vit-micro", "image_size": 16, "network": "classifier"})
    return recorder.save_model(create_model("tiny-cnn", len(CLASSES), 16).state_dict())


@pytest.mark.parametrize(
    "make, expect",
    [
        (_missing, r"model file .*missing\.pt does not exist"),
        (
            _text,
            r"notes\.pt is not a model file \(PyTorch cannot read it: \w+\); pass a run's model-best\.pt",
        ),
        (
            _json,
            r"summary\.json is not a model file \(PyTorch cannot read it: \w+\); pass a run's model-best\.pt",
        ),
        (
            _checkpoint,
            r"checkpoint-round-8\.pt is a per-round checkpoint, which resumes a run; pass .*model-best\.pt$",
        ),
        (
            _renamed_checkpoint,
            r"saved\.pt is a per-round checkpoint, which resumes a run; pass the run's model-best\.pt",
        ),
        (_plain, r"plain\.pt carries no fedderm metadata"),
        (_other_model, r"model\.pt: its weights do not fit model 'vit-micro' with 3 classes"),
    ],
    ids=["missing", "not-torch", "json", "checkpoint", "renamed-checkpoint", "no-metadata", "other-network"],
)
def test_wrong_model_file_is_one_line_naming_it(make, expect, image_folder, tmp_path, capsys):
    folder, _ = image_folder
    out = tmp_path / "pred.csv"
    assert main([str(make(tmp_path)), str(folder), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "weights_only" not in err[0]
    assert re.search(expect, err[0]), err[0]
    assert not out.exists()


def test_unreadable_image_names_the_file_or_is_skipped(saved_model, image_folder, tmp_path, capsys):
    folder, files = image_folder
    bad = folder / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    out = tmp_path / "pred.csv"
    assert main([str(saved_model / "model.pt"), str(folder), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot decode image") and str(bad) in err[0]
    assert main([str(saved_model / "model.pt"), str(folder), "-o", str(out), "--skip-bad-files"]) == 0
    assert [Path(r[0]) for r in read_csv(out)[1:]] == files
    assert str(bad) in capsys.readouterr().err
    assert main([str(saved_model / "model.pt"), str(tmp_path / "nowhere")]) == 1
    assert "nowhere does not exist" in capsys.readouterr().err


def test_python_m_writes_the_csv(saved_model, image_folder, tmp_path):
    folder, files = image_folder
    out = tmp_path / "pred.csv"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedderm.inference",
            str(saved_model / "model-best.pt"),
            str(folder),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(read_csv(out)) == 1 + len(files)
    assert b"\r" not in out.read_bytes()  # "\n" line ends, as every other CSV of a run
