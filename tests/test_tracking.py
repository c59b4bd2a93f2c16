"""TensorBoard tracking: the server's event files hold the numbers of rounds.csv."""

import csv
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import sim
from fedderm.metrics import METRIC_NAMES
from fedderm.results import RunRecorder

TINY = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 8,
    "num-server-rounds": 2,
    "local-epochs": 1,
    "batch-size": 8,
}


def read_events(run_dir):
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def csv_rows(run_dir):
    with open(run_dir / "rounds.csv") as fh:
        return list(csv.DictReader(fh))


def scalar_map(acc) -> dict[str, dict[int, float]]:
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def assert_events_match_csv(run_dir):
    scalars = scalar_map(read_events(run_dir))
    checked = 0
    for row in csv_rows(run_dir):
        if row["split"] in ("test", "global-test"):
            continue
        who = "mean" if row["client"] == "mean" else f"client-{row['client']}"
        for column in ("loss", *METRIC_NAMES, "train_loss"):
            tag = f"{row['split']}/{column}/{who}"
            if row[column] == "":
                assert int(row["round"]) not in scalars.get(tag, {}), tag
                continue
            # event files store float32
            assert scalars[tag][int(row["round"])] == pytest.approx(float(row[column]), rel=1e-6, abs=1e-7), (
                tag
            )
            checked += 1
    return checked, scalars


def test_recorder_writes_rounds_csv_values_and_final_table(tmp_path):
    rec = RunRecorder(tmp_path, "fedavg", {"tensorboard": True})
    for r, acc in enumerate((0.25, 0.5, 0.75)):
        rec.log_round(
            r,
            "val",
            {
                "0": {"accuracy": acc, "balanced_accuracy": acc / 2, "loss": 1.0 - acc, "num-examples": 10},
                "1": {"accuracy": acc + 0.1, "balanced_accuracy": float("nan"), "num-examples": 20},
            },
            train={"train_loss": 2.0 - r},
        )
    rec.track("probe", 3, {"knn": 0.4, "linear": float("nan")})
    rec.set_final({"0": {"accuracy": 0.9, "num-examples": 5}, "1": {"accuracy": 0.7, "num-examples": 5}}, 2)
    rec.finish()
    checked, scalars = assert_events_match_csv(tmp_path)
    assert checked >= 3 * 5
    assert scalars["val/accuracy/mean"] == pytest.approx({0: 0.3, 1: 0.55, 2: 0.8})
    assert scalars["val/train_loss/mean"] == pytest.approx({0: 2.0, 1: 1.0, 2: 0.0})
    assert "val/balanced_accuracy/client-1" not in scalars  # NaN is not plotted
    assert scalars["probe/knn"] == pytest.approx({3: 0.4}) and "probe/linear" not in scalars
    assert not any(tag.startswith("test/") for tag in scalars)
    text = read_events(tmp_path).Tensors("final_table/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "Final test metrics - fedavg (model from round 2)" in text and "0.900" in text


def test_no_events_without_the_key(tmp_path):
    rec = RunRecorder(tmp_path, "fedavg", {"tensorboard": False})
    rec.log_round(0, "val", {"0": {"accuracy": 0.5, "num-examples": 1}})
    rec.finish()
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_sim_run_writes_events_equal_to_rounds_csv(in_process, tmp_path):
    run_dir = sim.simulate(
        {**TINY, "output-dir": str(tmp_path), "cache-dir": str(tmp_path / "cache"), "run-name": "tb"},
        num_supernodes=2,
    )
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # the server's only
    checked, scalars = assert_events_match_csv(run_dir)
    assert {f"val/{m}/{w}" for m in METRIC_NAMES for w in ("mean", "client-0", "client-1")} <= set(scalars)
    assert sorted(scalars["val/accuracy/mean"]) == [0, 1, 2]
    assert checked >= 3 * 3 * len(METRIC_NAMES)
    assert all(math.isfinite(v) for tag in scalars.values() for v in tag.values())
