"""The health check of every evaluation (fedderm/health.py) and its place in the run folder."""

import json
import logging

import numpy as np
import pytest

from fedderm.health import ONE_CLASS_SHARE, HealthCheck, chance_band, one_class
from fedderm.metrics import CONFUSION_KEY
from fedderm.results import RunRecorder

NAMES = ["akiec", "bcc", "mel"]


def _cm(rows):
    return np.asarray(rows)


def test_one_class_needs_95_percent_of_predictions_and_two_classes_present():
    assert one_class(_cm([[10, 0, 0], [9, 1, 0], [10, 0, 0]])) == (0, pytest.approx(29 / 30))
    assert one_class(_cm([[10, 0, 0], [8, 2, 0], [10, 0, 0]])) is None  # 28/30 < 95 %
    assert one_class(_cm([[30, 0, 0], [0, 0, 0], [0, 0, 0]])) is None  # one class present
    assert one_class(_cm([[96, 0, 0], [2, 0, 0], [2, 0, 0]])) is None  # the labels are 96 % that class
    assert one_class(_cm([[0, 0, 0], [0, 0, 0], [0, 0, 0]])) is None
    assert ONE_CLASS_SHARE == 0.95


def test_chance_band_is_one_over_k_plus_the_larger_of_005_and_two_standard_errors():
    assert chance_band(5, 60) == pytest.approx(0.2 + 2 * np.sqrt(0.2 * 0.8 / 60))
    assert chance_band(2, 10_000) == pytest.approx(0.55)


def test_one_class_on_val_warns_after_two_consecutive_rounds_once_per_client():
    h = HealthCheck({"bn-stats": "round"})
    collapsed = {"0": _cm([[10, 0, 0], [10, 0, 0], [10, 0, 0]]), "1": np.eye(3) * 10}
    assert h.see(0, "val", collapsed, NAMES) == []  # the untrained model is not judged
    assert h.see(1, "val", collapsed, NAMES) == []  # one round: it may still be training
    (line,) = h.see(2, "val", collapsed, NAMES)
    assert "client 0: class 'akiec' for 100%" in line and "client 1" not in line and "\n" not in line
    assert "rounds 1-2" in line and "bn-stats" not in line  # the EMA hint only where bn-stats is "ema"
    assert h.see(3, "val", collapsed, NAMES) == []  # said once
    jumped = {"0": _cm([[0, 10, 0], [0, 10, 0], [0, 10, 0]]), "1": _cm([[0, 0, 10], [0, 0, 10], [0, 0, 10]])}
    assert h.see(4, "val", jumped, NAMES) == []  # client 1's first one-class round; client 0 said already
    (second,) = h.see(5, "val", jumped, NAMES)  # whichever class: one class in two rounds
    assert "client 1: class 'mel' for 100%" in second and "client 0" not in second
    assert h.warnings == [line, second]


def test_one_class_that_recovers_after_a_round_is_not_a_warning():
    h = HealthCheck()
    collapsed = {"0": _cm([[10, 0, 0], [10, 0, 0], [10, 0, 0]])}
    healthy = {"0": np.eye(3) * 10}
    for r, cms in enumerate([collapsed, collapsed, healthy, collapsed, healthy], start=0):
        h.see(r, "val", cms, NAMES, mean_balanced_accuracy=0.9, train_loss=1.0 / (r + 1))
    assert h.warnings == []


def test_one_class_on_a_test_split_warns_at_once_and_names_the_ema_cause():
    h = HealthCheck({"bn-stats": "ema"})
    (line,) = h.see(-1, "test", {"3": _cm([[0, 0, 5], [0, 0, 5], [0, 0, 5]])}, NAMES)
    assert "client 3: class 'mel' for 100% of its test images" in line
    assert 'bn-stats="round"' in line


def test_chance_for_three_rounds_while_the_train_loss_falls_warns_once():
    h = HealthCheck()
    spread = {"0": _cm([[4, 3, 3], [3, 4, 3], [3, 3, 4]])}  # not one class, but at chance
    bacc = 0.4  # <= chance_band(3, 30) = 0.505
    assert h.see(1, "val", spread, NAMES, bacc, train_loss=1.0) == []
    assert h.see(2, "val", spread, NAMES, bacc, train_loss=0.8) == []
    (line,) = h.see(3, "val", spread, NAMES, bacc, train_loss=0.5)
    assert "at chance (0.400 <= 0.505 for 3 classes) in rounds 1-3" in line and "1.000 -> 0.500" in line
    assert h.see(4, "val", spread, NAMES, bacc, train_loss=0.4) == []
    flat = HealthCheck()  # the train loss does not fall: no learning to contradict
    for r in (1, 2, 3):
        assert flat.see(r, "val", spread, NAMES, bacc, train_loss=1.0) == []
    above = HealthCheck()  # above the band
    for r in (1, 2, 3):
        assert above.see(r, "val", spread, NAMES, 0.6, train_loss=1.0 / r) == []


def test_a_new_stage_starts_the_consecutive_rounds_over():
    h = HealthCheck()
    collapsed = {"0": _cm([[10, 0, 0], [10, 0, 0], [10, 0, 0]])}
    h.see(0, "val", collapsed, NAMES)
    h.see(1, "val", collapsed, NAMES)  # the last round of pre-training's val
    h.see(0, "val", collapsed, NAMES)  # fine-tuning starts: round 0 again
    assert h.see(1, "val", collapsed, NAMES) == []
    assert len(h.see(2, "val", collapsed, NAMES)) == 1


def test_recorder_writes_warnings_to_summary_console_and_final_table_and_keeps_them_on_resume(
    tmp_path, caplog
):
    rec = RunRecorder(tmp_path / "run", "fedavg", {"bn-stats": "ema"})
    rec.set_classes(NAMES)
    bad = {
        "0": {"balanced_accuracy": 1 / 3, "num-examples": 30, CONFUSION_KEY: [10, 0, 0, 10, 0, 0, 10, 0, 0]}
    }
    good = {
        "0": {"balanced_accuracy": 1.0, "num-examples": 30, CONFUSION_KEY: [10, 0, 0, 0, 10, 0, 0, 0, 10]}
    }
    with caplog.at_level(logging.WARNING, logger="flwr"):  # Flower's logger: the console's round lines
        rec.log_round(1, "val", bad, train={"train_loss": 1.0})
        assert json.loads(rec.summary_path.read_text())["warnings"] == []
        rec.log_round(2, "val", bad, train={"train_loss": 0.5})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "class 'akiec'" in warned[0]
    rec.flush()  # summary.json is written when the run ends (rounds.jsonl as they come)
    assert json.loads(rec.summary_path.read_text())["warnings"] == warned
    resumed = RunRecorder(tmp_path / "run", "fedavg", {"bn-stats": "ema"}, state=rec.state())
    assert resumed.warnings == warned
    resumed.set_final(good, best_round=2)
    table = resumed.table()
    assert "[!] 1 health warning" in table.splitlines()[0] and table.splitlines()[-1] == f"[!] {warned[0]}"
    resumed.finish()
    assert (tmp_path / "run" / "final_table.txt").read_text().strip() == table
    healthy = RunRecorder(tmp_path / "ok", "fedavg", {})
    healthy.log_round(1, "val", good, train={"train_loss": 1.0})
    healthy.log_round(2, "val", good, train={"train_loss": 0.5})
    healthy.set_final(good, best_round=2)
    healthy.flush()
    assert json.loads(healthy.summary_path.read_text())["warnings"] == [] and "[!]" not in healthy.table()
