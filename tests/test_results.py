"""Tests for fedderm.results.RunRecorder and format_table."""

import csv
import json
import math

import pytest
import torch

from fedderm.metrics import METRIC_NAMES
from fedderm.results import RunRecorder, format_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def client_metrics(base, n, loss, auc=None):
    m = {name: base for name in METRIC_NAMES}
    m["auc"] = base if auc is None else auc
    m["num-examples"] = n
    m["loss"] = loss
    return m


def val_round(r):
    # client "10" has an undefined AUC in every round (NaN) to test null / NaN handling.
    return {
        "0": client_metrics(0.1 * r, 20, 1.0 / r),
        "1": client_metrics(0.1 * r + 0.2, 30, 2.0 / r),
        "10": client_metrics(0.1 * r + 0.4, 10, 3.0 / r, auc=float("nan")),
    }


FINAL = {
    "0": client_metrics(0.50, 25, 0.9),
    "1": client_metrics(0.60, 35, 0.8),
    "10": client_metrics(0.85, 15, 0.7, auc=float("nan")),
}
CONFIG = {"seed": 0, "method": "fedavg", "lr": 0.05, "num-server-rounds": 3, "data-path": ""}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "fedavg-test"
    rec = RunRecorder(run_dir, "fedavg", CONFIG)
    means = [rec.log_round(r, "val", val_round(r), train={"train_loss": 1.5 / r}) for r in (1, 2, 3)]
    final_mean = rec.set_final(FINAL, best_round=3, extra={"missing_clients": ["7"]})
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1.0, -1.0])}
    model_path = rec.save_model(state)
    out = rec.finish()
    return rec, run_dir, means, final_mean, state, model_path, out


def test_config_written_immediately(tmp_path):
    run_dir = tmp_path / "a" / "b"
    RunRecorder(run_dir, "fedavg", CONFIG)
    text = (run_dir / "config.json").read_text()
    assert json.loads(text) == CONFIG
    assert list(json.loads(text)) == sorted(CONFIG)
    assert text.startswith('{\n  "')  # indent 2


def test_log_round_returns_unweighted_mean_and_appends_csv(tmp_path):
    rec = RunRecorder(tmp_path / "run", "fedavg", CONFIG)
    mean = rec.log_round(1, "val", val_round(1))
    assert mean["balanced_accuracy"] == pytest.approx((0.1 + 0.3 + 0.5) / 3)
    assert mean["auc"] == pytest.approx((0.1 + 0.3) / 2)
    assert mean["loss"] == pytest.approx((1.0 + 2.0 + 3.0) / 3)
    # on disk right away, before finish(): the rows and the round's entry, appended
    with open(tmp_path / "run" / "rounds.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 4
    (line,) = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    assert json.loads(line) == rec.summary()["rounds"][0]
    # summary.json, rewritten whole, waits for the end (flush): its bytes grow with the run, not its square
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds"] == []
    rec.flush()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["rounds"]) == 1 and summary["final"] is None


def test_rounds_csv(finished_run):
    _, run_dir, means, *_ = finished_run
    with open(run_dir / "rounds.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert reader.fieldnames == [
        "round",
        "split",
        "client",
        "num-examples",
        "loss",
        *METRIC_NAMES,
        "train_loss",
    ]
    assert len(rows) == 3 * (3 + 1) + (3 + 1)  # three val rounds, then the test rows
    assert [r["client"] for r in rows[:4]] == ["0", "1", "10", "mean"]
    test_rows = rows[-4:]
    assert [(r["round"], r["split"], r["client"]) for r in test_rows] == [
        ("3", "test", "0"),
        ("3", "test", "1"),
        ("3", "test", "10"),
        ("3", "test", "mean"),
    ]
    assert float(test_rows[1]["balanced_accuracy"]) == FINAL["1"]["balanced_accuracy"]
    for r in (1, 2, 3):
        block = [row for row in rows if row["round"] == str(r) and row["split"] == "val"]
        per_client = val_round(r)
        for row in block:
            assert row["split"] == "val"
            if row["client"] == "mean":
                assert int(row["num-examples"]) == 60
                assert float(row["train_loss"]) == 1.5 / r
                assert float(row["balanced_accuracy"]) == pytest.approx(means[r - 1]["balanced_accuracy"])
                assert float(row["balanced_accuracy"]) == pytest.approx(
                    (0.1 * r + (0.1 * r + 0.2) + (0.1 * r + 0.4)) / 3
                )
                assert float(row["loss"]) == pytest.approx((1.0 + 2.0 + 3.0) / 3 / r)
            else:
                expected = per_client[row["client"]]
                assert int(row["num-examples"]) == expected["num-examples"]
                assert float(row["loss"]) == expected["loss"]  # exact round-trip
                assert row["train_loss"] == ""
                for name in METRIC_NAMES:
                    if math.isnan(expected[name]):
                        assert row[name] == ""
                    else:
                        assert float(row[name]) == expected[name]


def test_summary_json_contract(finished_run):
    _, run_dir, _, final_mean, *_ = finished_run
    text = (run_dir / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    summary = json.loads(text)
    assert {"method", "config", "rounds", "best_round", "final"} <= set(summary)
    assert summary["method"] == "fedavg"
    assert summary["config"] == CONFIG
    assert summary["best_round"] == 3
    assert summary["missing_clients"] == ["7"]

    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    for entry in summary["rounds"]:
        r = entry["round"]
        assert entry["split"] == "val"
        assert entry["train"] == {"train_loss": pytest.approx(1.5 / r)}
        assert set(METRIC_NAMES) <= set(entry["metrics"])
        assert entry["metrics"]["f1"] == pytest.approx((0.3 * r + 0.6) / 3)
        assert entry["metrics"]["auc"] == pytest.approx((0.2 * r + 0.2) / 2)
        assert set(entry["per_client"]) == {"0", "1", "10"}
        assert entry["per_client"]["10"]["auc"] is None  # NaN -> null
        assert entry["per_client"]["1"]["num-examples"] == 30

    final = summary["final"]
    for name in METRIC_NAMES:
        assert name in final
    assert final["balanced_accuracy"] == pytest.approx((0.50 + 0.60 + 0.85) / 3)
    assert final["auc"] == pytest.approx((0.50 + 0.60) / 2)
    assert final["balanced_accuracy"] == pytest.approx(final_mean["balanced_accuracy"])
    assert set(final["per_client"]) == {"0", "1", "10"}
    assert final["per_client"]["10"] == {
        **{name: 0.85 for name in METRIC_NAMES},
        "auc": None,
        "num-examples": 15,
        "loss": 0.7,
    }


def test_summary_all_nan_mean_is_null(tmp_path):
    rec = RunRecorder(tmp_path / "run", "fedavg", {})
    per_client = {
        "0": {"auc": float("nan"), "num-examples": 3},
        "1": {"auc": float("nan"), "num-examples": 4},
    }
    mean = rec.log_round(1, "val", per_client)
    assert math.isnan(mean["auc"])
    rec.set_final(per_client, best_round=None)
    rec.flush()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"][0]["metrics"]["auc"] is None
    assert summary["final"]["auc"] is None
    assert summary["best_round"] is None


def test_extra_cannot_override_contract(tmp_path):
    rec = RunRecorder(tmp_path / "run", "fedavg", {})
    with pytest.raises(ValueError):
        rec.set_final(FINAL, best_round=1, extra={"final": 1})
    rec.update_extra({"rounds_to_target": 2})
    rec.flush()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds_to_target"] == 2


def test_model_roundtrip(finished_run):
    _, run_dir, _, _, state, model_path, _ = finished_run
    assert model_path == run_dir / "model.pt"
    loaded = torch.load(model_path, weights_only=True)
    assert set(loaded) == set(state)
    for key in state:
        assert torch.equal(loaded[key], state[key])


def test_pngs_and_finish(finished_run):
    _, run_dir, _, _, _, _, out = finished_run
    assert out == run_dir
    for name in ("curves.png", "train_loss.png"):
        path = run_dir / name
        data = path.read_bytes()
        assert len(data) > 1000
        assert data[:8] == PNG_MAGIC
    assert not list(run_dir.glob(".*.tmp"))  # no temp files left behind


def test_no_train_loss_png_without_train(tmp_path):
    rec = RunRecorder(tmp_path / "run", "fedavg", {})
    rec.log_round(1, "val", val_round(1))
    rec.finish()
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "run" / "train_loss.png").exists()


def test_table(finished_run):
    rec, run_dir, *_ = finished_run
    text = rec.table()
    lines = text.splitlines()
    assert "fedavg" in lines[0]
    header = next(line for line in lines if line.startswith("client"))
    for name in METRIC_NAMES:
        assert name in header
    rows = {
        line.split()[0]: line.split()[1:]
        for line in lines
        if line.split() and line.split()[0] in {"0", "1", "10", "mean"}
    }
    assert set(rows) == {"0", "1", "10", "mean"}
    col = {name: i for i, name in enumerate([*METRIC_NAMES, "n"])}
    assert rows["0"][col["balanced_accuracy"]] == "0.500"
    assert rows["10"][col["auc"]] == "n/a"
    assert rows["10"][col["n"]] == "15"
    assert rows["mean"][col["balanced_accuracy"]] == "0.650"  # (0.50+0.60+0.85)/3
    assert rows["mean"][col["auc"]] == "0.550"  # (0.50+0.60)/2, NaN ignored
    assert rows["mean"][col["n"]] == "75"
    assert (run_dir / "final_table.txt").read_text().strip() == text.strip()


def test_format_table_orders_clients_naturally():
    text = format_table({"10": {"accuracy": 1.0}, "2": {"accuracy": 0.0}}, "T")
    order = [
        line.split()[0]
        for line in text.splitlines()
        if line.split() and line.split()[0] in {"2", "10", "mean"}
    ]
    assert order == ["2", "10", "mean"]
