"""End to end: sim.py runs the real ServerApp/ClientApp in Flower's simulation runtime."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import sim
from fedderm.config import ConfigError
from fedderm.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[1]
FAST = {
    "model": "tiny-cnn",
    "image-size": 32,
    "synthetic-per-class": 40,
    "num-server-rounds": 2,
    "local-epochs": 2,
    "batch-size": 16,
    "lr": 0.05,
}


@pytest.mark.federation
def test_fedavg_on_ray_with_a_failing_and_a_silent_client_writes_results_and_learns(tmp_path, monkeypatch):
    """The Ray path, once: four hospitals, and in round 2 one client's handler raises and another
    never answers (``tests/faults.py``).  The run goes on without them in round 2 and records why,
    has every client back for round 3 and the test, writes its results and learns."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{ROOT / 'tests'}")  # Ray workers import tests/faults.py
    monkeypatch.setenv("FEDDERM_TEST_FAULTS", json.dumps([[0, 2, "raise"], [1, 2, "hang"]]))
    monkeypatch.setenv("FEDDERM_TEST_HANG", "30")  # past round 2's 25 s timeout; free early in round 3
    import faults

    run_dir = sim.simulate(
        {
            **FAST,
            "num-server-rounds": 3,
            "round-timeout": 25.0,
            "partition": "iid",
            "synthetic-sites": 1,
            "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "cache"),
            "run-name": "e2e",
        },
        num_supernodes=4,
        client_app=faults.app,
    )
    assert run_dir == tmp_path / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["method"] == "fedavg" and summary["config"]["num-server-rounds"] == 3
    # each client records its PyTorch threads: Ray gives an actor its num_cpus (--cpus-per-client 1)
    assert {d["torch-threads"] for d in summary["config"]["client-data"].values()} == {1}
    missing = {(m["round"], m["partition-id"]): m["reason"] for m in summary["missing_clients"]}
    assert "injected failure" in missing[(2, "0")]
    assert missing[(2, "1")].startswith("no reply within round-timeout")
    assert not any(r == 3 for r, _ in missing), missing
    rounds = [r for r in summary["rounds"] if r["split"] == "val"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    for metric in METRIC_NAMES:
        assert metric in summary["final"]
    per = summary["final"]["per_client"]
    assert set(per) == {"0", "1", "2", "3"}
    assert sum(c["num-examples"] for c in per.values()) == 40  # 5 classes x 40 images x 20 % test
    assert all(0.0 <= c["balanced_accuracy"] <= 1.0 for c in per.values())
    # the final mean is the unweighted mean over clients
    assert summary["final"]["accuracy"] == pytest.approx(np.mean([c["accuracy"] for c in per.values()]))
    # training helped: the best val accuracy beats the random model of round 0
    assert max(r["metrics"]["accuracy"] for r in rounds[1:]) > rounds[0]["metrics"]["accuracy"]
    with open(run_dir / "rounds.csv") as f:
        rows = list(csv.DictReader(f))
    assert {row["client"] for row in rows} >= {"0", "1", "2", "3", "mean"}
    state = torch.load(run_dir / "model.pt")
    assert "head.weight" in state and state["head.weight"].shape[0] == 5
    assert (run_dir / "config.json").exists() and (run_dir / "curves.png").stat().st_size > 0


def test_same_seed_same_numbers(in_process, tmp_path):
    """Determinism on CPU: two runs with one seed give identical metrics and weights."""
    dirs = [
        sim.simulate(
            {
                **FAST,
                "num-server-rounds": 1,
                "output-dir": str(tmp_path / str(i)),
                "cache-dir": str(tmp_path / "cache"),
                "run-name": "r",
            },
            num_supernodes=2,
        )
        for i in range(2)
    ]
    a, b = (json.loads((d / "summary.json").read_text()) for d in dirs)
    assert a["final"] == b["final"] and a["rounds"] == b["rounds"]
    wa, wb = (torch.load(d / "model.pt") for d in dirs)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_key_fails_before_starting():
    with pytest.raises(ConfigError, match="'num-server-round'"):
        sim.simulate({"num-server-round": 2})


def _medmnist_like(path, n=300, size=28, classes=4, seed=0):
    """A small MedMNIST-format file: grayscale images whose brightness encodes the label."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, m in (("train", n), ("val", n // 5), ("test", n // 5)):
        labels = rng.integers(0, classes, (m, 1))
        images = (labels[:, :, None] * 60 + rng.integers(0, 40, (m, size, size))).astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("method,extra", [("fedavg", {}), ("fedprox", {"proximal-mu": 0.01})])
def test_npz_dirichlet_reports_per_client_metrics(in_process, tmp_path, method, extra):
    npz = _medmnist_like(tmp_path / "organmnist.npz")
    run_dir = sim.simulate(
        {
            **FAST,
            "dataset": "npz",
            "data-path": str(npz),
            "image-size": 28,
            "partition": "dirichlet",
            "dirichlet-alpha": 0.5,
            "method": method,
            "num-server-rounds": 2,
            "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "cache"),
            **extra,
        },
        num_supernodes=3,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["method"] == method
    assert set(summary["final"]["per_client"]) == {"0", "1", "2"}
    assert sum(c["num-examples"] for c in summary["final"]["per_client"].values()) == pytest.approx(
        0.2 * 420, abs=6
    )
    if method == "fedprox":
        assert summary["config"]["proximal-mu"] == 0.01
