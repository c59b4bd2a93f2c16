"""test-set="global" (docs/test-sets.md), the class list and per-class results, fedderm.inference."""

import csv
import json

import numpy as np
import pytest
import torch

import sim
from bench.loop_grid import simulate
from fedderm.config import ConfigError

SIZES = {"train": 60, "val": 15, "test": 21}


def write_npz(path, seed=0):
    """A 3-class MedMNIST-style npz; the class is visible in the image (mean brightness)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in SIZES.items():
        labels = np.arange(n) % 3
        rng.shuffle(labels)
        images = (labels[:, None, None] * 100 + rng.integers(0, 40, (n, 12, 12))).astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels[:, None]
    np.savez(path, **arrays)
    return arrays


FAST = {
    "model": "tiny-cnn",
    "image-size": 16,
    "num-server-rounds": 1,
    "local-epochs": 1,
    "batch-size": 16,
    "lr": 0.05,
    "partition": "iid",
    "dataset": "npz",
    "classes": "dark,mid,bright",
}


@pytest.fixture(scope="module")
def global_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("global")
    arrays = write_npz(tmp / "three.npz")
    # in this process, as conftest's in_process runs sim.simulate
    run_dir = simulate(
        {
            **FAST,
            "data-path": str(tmp / "three.npz"),
            "test-set": "global",
            "output-dir": str(tmp),
            "cache-dir": str(tmp / "cache"),
            "run-name": "g",
        },
        num_supernodes=2,
    )
    return run_dir, arrays, json.loads((run_dir / "summary.json").read_text())


def test_global_test_set_is_the_npz_test_arrays_and_never_trained_on(global_run):
    run_dir, arrays, summary = global_run
    final = summary["final"]
    test_labels = arrays["test_labels"][:, 0]
    assert final["test_set"] == "global"
    assert final["num-examples"] == SIZES["test"] == len(test_labels)
    # the confusion matrix of the final model counts exactly the test_* labels, class by class
    cm = np.array(final["confusion_matrix"])
    assert cm.shape == (3, 3) and cm.sum() == SIZES["test"]
    assert cm.sum(axis=1).tolist() == np.bincount(test_labels, minlength=3).tolist()
    # the clients' splits hold exactly train_* + val_* (val = the official val_*): no test image
    counts = summary["classes"]["counts"]
    assert set(counts) == {"0", "1"}
    names = summary["classes"]["names"]
    assert names == ["dark", "mid", "bright"]
    total = {
        s: np.sum([[c[s][n] for n in names] for c in counts.values()], axis=0)
        for s in ("train", "val", "test")
    }
    assert (total["val"] == np.bincount(arrays["val_labels"][:, 0], minlength=3)).all()
    assert (total["train"] + total["test"] == np.bincount(arrays["train_labels"][:, 0], minlength=3)).all()
    # next to it: the per-client test means on the clients' own test splits
    assert final["per_client_mean"]["num-examples"] == int(total["test"].sum())
    assert set(final["per_client"]) == {"0", "1"}
    # both clients evaluated one global model on the whole global test set
    assert {c["num-examples"] for c in final["global_test"]["per_client"].values()} == {SIZES["test"]}
    with open(run_dir / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    gt = [r for r in rows if r["split"] == "global-test"]
    assert [r["client"] for r in gt] == ["0", "1", "mean"]
    assert float(gt[-1]["balanced_accuracy"]) == pytest.approx(final["balanced_accuracy"])
    assert [r["client"] for r in rows if r["split"] == "test"] == ["0", "1", "mean"]


def test_summary_carries_class_names_per_class_metrics_and_confusion(global_run):
    run_dir, _, summary = global_run
    final = summary["final"]
    cm = np.array(final["confusion_matrix"])
    per = final["per_class"]
    assert list(per) == ["dark", "mid", "bright"]
    for i, name in enumerate(per):
        assert per[name]["support"] == cm[i].sum()
        if cm[i].sum():
            assert per[name]["recall"] == pytest.approx(cm[i, i] / cm[i].sum())
    for client in final["per_client"].values():
        assert np.array(client["confusion_matrix"]).sum() == client["num-examples"]
        assert list(client["per_class"]) == ["dark", "mid", "bright"]


def test_model_file_carries_class_names_and_labels_a_prediction(global_run, tmp_path):
    from fedderm.inference import load_model

    run_dir, arrays, _ = global_run
    state = torch.load(run_dir / "model.pt")
    assert state._metadata["fedderm"]["classes"] == ["dark", "mid", "bright"]
    clf = load_model(run_dir / "model-best.pt")
    assert clf.classes == ["dark", "mid", "bright"] and clf.image_size == 16
    images = torch.full((2, 3, 16, 16), 255, dtype=torch.uint8)
    labelled = clf.predict(images)
    probs = clf.probabilities(images)
    assert len(labelled) == 2
    assert labelled[0][0] == clf.classes[int(probs[0].argmax())]
    assert labelled[0][1] == pytest.approx(float(probs[0].max()))


def test_unknown_test_set_names_the_choices():
    with pytest.raises(ConfigError, match=r"'test-set' must be one of \['per-client', 'global'\]"):
        sim.simulate({"test-set": "globl"})


def test_missing_test_data_path_names_key_and_file(tmp_path):
    with pytest.raises(ConfigError, match=r"'test-data-path'.*nope\.npz.*does not exist"):
        sim.simulate({"test-set": "global", "test-data-path": str(tmp_path / "nope.npz")})


def test_per_class_csv_confusion_csv_and_png(global_run):
    run_dir, _, summary = global_run
    with open(run_dir / "per_class.csv") as fh:
        rows = list(csv.DictReader(fh))
    first = [r for r in rows if r["set"] == "global-test"]
    assert [r["class"] for r in first] == ["dark", "mid", "bright"]
    per = summary["final"]["per_class"]
    assert [int(r["support"]) for r in first] == [per[n]["support"] for n in ("dark", "mid", "bright")]
    assert {r["client"] for r in rows if r["set"] == "test"} == {"0", "1"}
    with open(run_dir / "confusion_matrix.csv") as fh:
        cm_rows = [r for r in csv.reader(fh)][1:4]
    assert [[int(v) for v in r[3:]] for r in cm_rows] == summary["final"]["confusion_matrix"]
    assert (run_dir / "confusion.png").stat().st_size > 0


def test_two_stage_loss_plot_has_both_stages(tmp_path):
    from fedderm.results import RunRecorder

    rec = RunRecorder(tmp_path / "r", "fedmae", {"seed": 0})
    for r in (1, 2):
        rec.log_round(r, "pretrain", {"0": {"loss": 1.0 / r, "num-examples": 4}})
    for r in (0, 1):
        rec.log_round(
            r, "val", {"0": {"balanced_accuracy": 0.5, "num-examples": 4}}, train={"train_loss": 0.3}
        )
    fig_calls = []
    import matplotlib.figure

    original = matplotlib.figure.Figure.subplots

    def spy(self, *a, **k):
        axes = original(self, *a, **k)
        fig_calls.append(self)
        return axes

    matplotlib.figure.Figure.subplots = spy
    try:
        rec.finish()
    finally:
        matplotlib.figure.Figure.subplots = original
    loss_fig = [f for f in fig_calls if len(f.axes) == 2][0]
    titles = [ax.get_title() for ax in loss_fig.axes]
    assert "stage 1: self-supervised pre-training" in titles[0] and "stage 2: fine-tuning" in titles[1]
    assert (tmp_path / "r" / "train_loss.png").exists()
