"""``val-in-train``: round r's val evaluation rides in round r+1's train message ("fewer
exchanges per round"): one exchange per round instead of two, and the recorded metrics identical
to the separate evaluate messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import strategies.common as common
import wire
from bench.loop_grid import TINY_RUN, LoopGrid, run_app


class Killed(RuntimeError):
    pass


@pytest.fixture
def sent(monkeypatch):
    """Every message type the server pushes, in order (train messages with a val ride as ``train+val``)."""
    kinds: list[str] = []
    push = LoopGrid.push_messages

    def counting(self, messages):
        messages = list(messages)
        for m in messages:
            config = m.content["config"] if "config" in m.content.config_records else {}
            kinds.append(m.metadata.message_type + ("+val" if wire.VAL_ROUND in config else ""))
        return push(self, messages)

    monkeypatch.setattr(LoopGrid, "push_messages", counting)
    return kinds


def _results(run_dir: Path) -> tuple[dict, str, dict]:
    summary = json.loads((run_dir / "summary.json").read_text())
    models = {p.name: torch.load(p) for p in sorted(run_dir.glob("model*.pt"))}
    return summary, (run_dir / "rounds.csv").read_text(), models


def _same(a: tuple, b: tuple) -> None:
    (sa, ca, ma), (sb, cb, mb) = a, b
    assert ca == cb  # rounds.csv: every round's val metrics per client, the train loss, the test rows
    for key in ("rounds", "final", "best_round", "rounds_to_target", "bytes_per_round"):
        assert sa.get(key) == sb.get(key), key
    assert [r["round"] for r in sa["round_seconds"]] == [r["round"] for r in sb["round_seconds"]]
    assert ma.keys() == mb.keys() == {"model.pt", "model-best.pt"}
    for name in ma:
        assert all(torch.equal(ma[name][k], mb[name][k]) for k in ma[name]), name


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_val_in_train_records_the_same_metrics_with_one_exchange_per_round(method, tmp_path, sent):
    base = {**TINY_RUN, "method": method, "cache-dir": str(tmp_path / "c"), "output-dir": str(tmp_path / "o")}
    if method == "fedprox":
        base["proximal-mu"] = 0.1
    separate = _results(run_app({**base, "val-in-train": False, "run-name": "separate"}))
    kinds_separate = list(sent)
    sent.clear()
    ridden = _results(run_app({**base, "val-in-train": True, "run-name": "ridden"}))
    _same(separate, ridden)
    rounds = TINY_RUN["num-server-rounds"]
    assert len(separate[0]["rounds"]) == rounds + 1  # val of rounds 0..R
    assert kinds_separate.count("evaluate") == 2 * (rounds + 2)  # 2 clients: val 0..R + test
    assert kinds_separate.count("train") == 2 * rounds
    # with the ride: rounds 0..R-1's val in the R train messages, only round R's val and test apart
    assert sent.count("train+val") == 2 * rounds and "train" not in sent
    assert sent.count("evaluate") == 2 * 2
    assert [r["round"] for r in ridden[0]["round_seconds"]] == list(range(rounds + 1))


def test_resume_with_a_pending_val_is_identical(tmp_path, monkeypatch, sent):
    """Killed before the round-3 checkpoint: round 2's checkpoint holds its val as pending, the
    resumed run evaluates it in its first train message; the same results as a run without a stop."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = {
        **TINY_RUN,
        "method": "fedavg",
        "cache-dir": str(tmp_path / "c"),
        "output-dir": str(tmp_path / "o"),
    }
    full = _results(run_app({**base, "run-name": "full"}))
    save = common.save_checkpoint
    pending = []

    def die_in_round_3(run_dir, stage, server_round, payload, keep=3):
        pending.append(payload.get("val-pending"))
        if server_round == 3:
            raise Killed("server killed before the round-3 checkpoint")
        return save(run_dir, stage, server_round, payload, keep)

    monkeypatch.setattr(common, "save_checkpoint", die_in_round_3)
    with pytest.raises(Killed):
        run_app({**base, "run-name": "crashed"})
    monkeypatch.setattr(common, "save_checkpoint", save)
    assert pending[-3:] == [True, True, True]
    sent.clear()
    crashed = tmp_path / "o" / "crashed"
    assert run_app({"resume": str(crashed)}) == crashed
    resumed = [k for k in sent if k != "query.info"]
    assert resumed[:2] == ["train+val", "train+val"]  # round 2's val rides in round 3's train
    _same(full, _results(crashed))
