"""Client state that survives: the state store, exact resume for every stateful
method, FedCLF's relay screening."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.clientapp import ClientApp

import client_app as real
import registry
import strategies.common as common
from bench.loop_grid import TINY_RUN, run_app
from fedderm.state_store import StateStore

TINY = {**TINY_RUN, "finetune-rounds": 1, "finetune-epochs": 1}
MOCO = {"fedclf.queue-size": 24}
#: every method whose clients keep state between rounds (and SiFT, whose state is the server's), and
#: the stateless baselines of 003 (their methods' smallest settings), whose resume rests on the
#: server's checkpoint alone
METHODS = {
    "fedclf": MOCO,
    "fedmoco": MOCO,
    "localcl": MOCO,
    "moon": {},
    "scaffold": {},
    "feddyn": {},
    "fedbn": {},
    "flbt": {},
    "local": {},
    "sift": {},
    "fedbyol": {"byol.hidden-dim": 32, "byol.proj-dim": 16},
    "fedema": {"byol.hidden-dim": 32, "byol.proj-dim": 16},
    # FedSSL-S on FedEMA: each centre keeps its own pre-training network and lambda
    "ssl-flbt": {
        "ssl.pretrain": "federated",
        "ssl.tasks": "simclr",
        "ssl.finetune": "fedavg",
        "ssl.rounds": 3,
        "ssl.epochs": 1,
    },
    "fedmocov3": registry.get_method("fedmocov3").smallest,
    "semifl": registry.get_method("semifl").smallest,
    "fedmae": {
        "model": "vit-micro",
        "fedmae.decoder-embed-dim": 32,
        "fedmae.decoder-depth": 1,
        "fedmae.decoder-num-heads": 2,
    },
}
#: methods whose clients keep no state between rounds
STATELESS = ("sift", "flbt", "fedmocov3", "semifl")


class Killed(Exception):
    """Stands for the server process dying."""


@pytest.fixture
def flwr_log(caplog):
    logger = logging.getLogger("flwr")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def fake_text_embeddings(monkeypatch):
    def encode(model_name, texts, pooling="mean"):
        return torch.randn(len(texts), 12, generator=torch.Generator().manual_seed(len(texts)))

    monkeypatch.setattr("fedderm.sift.encode_texts", encode)


def _results(run_dir: Path) -> tuple[dict, dict]:
    summary = json.loads((run_dir / "summary.json").read_text())
    models = {p.name: torch.load(p) for p in sorted(run_dir.glob("model*.pt"))}
    return summary, models


@pytest.mark.parametrize("method", sorted(METHODS))
def test_resume_after_a_crash_is_bit_identical(method, tmp_path, monkeypatch, flwr_log):
    """Killed during round 3 (after the round-2 checkpoint, the clients already past it) and
    resumed: the same final metrics, rounds and weights as an uninterrupted run."""
    if method == "sift":
        fake_text_embeddings(monkeypatch)
    # not a simulation (no run folder in the stamp): the deployment default, $XDG_CACHE_HOME/fedderm
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = {
        **TINY,
        **METHODS[method],
        "method": method,
        "cache-dir": str(tmp_path / "cache"),
        "output-dir": str(tmp_path / "out"),
    }
    full = run_app({**base, "run-name": "full"})

    save = common.save_checkpoint
    killed = []

    def die_in_round_3(run_dir, stage, server_round, payload, keep=3):
        if server_round == 3 and not killed:
            killed.append(stage)
            raise Killed(f"server killed before the {stage} round-3 checkpoint")
        return save(run_dir, stage, server_round, payload, keep)

    monkeypatch.setattr(common, "save_checkpoint", die_in_round_3)
    with pytest.raises(Killed):
        run_app({**base, "run-name": "crashed"})
    crashed = tmp_path / "out" / "crashed"
    assert json.loads((crashed / "summary.json").read_text()).get("final") is None  # no test yet
    stored = sorted((tmp_path / "xdg" / "fedderm" / "client-state" / "crashed").glob("client-*/step-*.json"))
    flwr_log.clear()
    resumed = run_app({"resume": str(crashed)})
    assert resumed == crashed
    (a, wa), (b, wb) = _results(full), _results(resumed)
    assert a["final"] == b["final"] and a["rounds"] == b["rounds"] and a["best_round"] == b["best_round"]
    timed = [[(e["stage"], e["round"]) for e in s.get("round_seconds", [])] for s in (a, b)]
    assert timed[0] == timed[1] and len(timed[0]) == len(set(timed[0]))  # every round timed once
    assert wa.keys() == wb.keys() and (wa or method == "local")  # local: the models stay on the clients
    for name in wa:
        assert wa[name].keys() == wb[name].keys()
        assert all(torch.equal(wa[name][k], wb[name][k]) for k in wa[name]), name
    if method not in STATELESS:  # the others' clients had gone past step 2
        assert stored
        assert "rolled back to step" in flwr_log.text


def _store(tmp_path, keep=3):
    return StateStore(tmp_path / "client-0", keep=keep, label="client 0")


def test_store_rewrites_only_what_changed_and_keeps_keep_steps(tmp_path):
    store = _store(tmp_path, keep=2)
    big, small = {"w": torch.arange(6.0)}, {"c": torch.ones(2)}
    for step in range(1, 6):
        snap = store.open(step)
        if step == 1:
            snap.put("big", big)
        snap.put("small", {"c": small["c"] * step}, meta={"round": step})
        snap.commit()
    files = sorted(p.name for p in store.folder.glob("*.safetensors"))
    assert files == [
        "big.s1.0.safetensors",
        "small.s3.0.safetensors",
        "small.s4.0.safetensors",
        "small.s5.0.safetensors",
    ]  # big written once; steps 3, 4 (keep=2) and 5 kept
    assert store.steps() == [3, 4, 5]
    snap = store.open(4)
    assert torch.equal(snap.tensors("big")["w"], big["w"]) and snap.meta("small") == {"round": 4}
    assert torch.equal(snap.tensors("small")["c"], torch.full((2,), 4.0))
    assert store.open(9).base_step == 5


def test_rollback_once_per_server_session(tmp_path):
    store = _store(tmp_path)
    assert store.start_session("run-a", 0) is None
    for step in (1, 2, 3):
        snap = store.open(step)
        snap.put("x", {"v": torch.tensor([float(step)])})
        snap.commit()
    note = store.start_session("run-b", 2)  # a resumed server: its newest checkpoint is step 2
    assert "at step 3" in note and "rolled back to step 2" in note
    assert store.steps() == [1, 2]
    assert store.start_session("run-b", 2) is None  # same server process: nothing more to do
    assert float(store.open(3).tensors("x")["v"]) == 2.0


def test_truncated_state_file_is_named_and_the_previous_step_used(tmp_path, caplog):
    store = _store(tmp_path)
    for step in (1, 2):
        snap = store.open(step)
        snap.put("bank", {"features": torch.full((4, 3), float(step))})
        snap.commit()
    damaged = store.folder / "bank.s2.0.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-7])  # a crash of the machine mid-write
    with caplog.at_level(logging.ERROR, logger="fedderm.state"):
        snap = store.open(3)
    assert str(damaged) in caplog.text and "truncated" in caplog.text
    assert snap.base_step == 1 and float(snap.tensors("bank")["features"][0, 0]) == 1.0
    # a damaged header with the right size is caught too
    snap.put("bank", {"features": torch.zeros(4, 3)})
    snap.commit()
    path = store.folder / "bank.s3.0.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:16] = b"\xff" * 8
    path.write_bytes(bytes(raw))
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="fedderm.state"):
        assert store.open(3).base_step == 1
    assert str(path) in caplog.text


# -- FedCLF: nothing unscreened is relayed ------------------------------------------------------
def bad_features_mod(msg, context, call_next):
    """Client 0 uploads NaN features in pre-training round 1; every client notes what it receives."""
    out = call_next(msg, context)
    pid = context.node_config["partition-id"]
    config = msg.content.config_records.get("config", {})
    if msg.metadata.message_type == "train.pretrain":
        remote = msg.content.array_records.get("remote-features")
        rows = remote["features"].numpy() if remote is not None else np.empty((0, 128))
        RECEIVED.append((pid, int(config["server-round"]), len(rows), bool(np.isfinite(rows).all())))
        if pid == 0 and config["server-round"] == 1:
            values = out.content["features"]["features"].numpy()
            out.content["features"] = ArrayRecord({"features": Array(np.full_like(values, np.nan))})
    return out


RECEIVED: list[tuple[int, int, int, bool]] = []


def test_fedclf_nan_feature_upload_is_rejected_and_never_relayed(tmp_path, flwr_log, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    RECEIVED.clear()
    app = real.register(ClientApp(mods=[*real.MODS, bad_features_mod]))
    run_dir = run_app(
        {
            **TINY,
            **MOCO,
            "method": "fedclf",
            "num-server-rounds": 2,
            "finetune": "none",
            "cache-dir": str(tmp_path / "cache"),
            "output-dir": str(tmp_path / "out"),
        },
        num_clients=3,
        client_app=app,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    missing = summary["missing_clients"]
    assert [(m["round"], m["partition-id"]) for m in missing] == [(1, "0")]
    assert "non-finite" in missing[0]["reason"] and "features" in missing[0]["reason"]
    assert "client 0 (node" in flwr_log.text and "features hold non-finite values" in flwr_log.text
    assert all(finite for *_, finite in RECEIVED)
    round2 = {pid: rows for pid, rnd, rows, _ in RECEIVED if rnd == 2}
    # round 2: client 0's round-1 upload was refused, so clients 1 and 2 get one other client's
    # 24 features each; client 0 gets both of theirs
    assert round2 == {0: 48, 1: 24, 2: 24}
    assert len(summary["rounds"]) == 2  # the run went on


def test_put_without_copy_keeps_the_tensors_and_the_default_copies():
    from fedderm.state_store import Snapshot

    snap = Snapshot(None, 1, None, {})
    fresh = {"w": torch.arange(6.0)}
    snap.put("owned", fresh, copy=False)
    snap.put("copied", fresh)
    assert snap.tensors("owned")["w"].data_ptr() == fresh["w"].data_ptr()
    assert snap.tensors("copied")["w"].data_ptr() != fresh["w"].data_ptr()
    assert torch.equal(snap.tensors("copied")["w"], fresh["w"])


@pytest.mark.parametrize("method", ["scaffold", "feddyn", "moon"])
def test_one_state_write_per_train_message_and_no_copy_on_put(method, tmp_path, monkeypatch):
    """A SCAFFOLD/FedDyn/MOON client writes its state once per train
    message (evaluate messages write nothing) and hands it to the store without a copy."""
    import fedderm.state_store as store

    writes, copies = [], []
    save, put = store.save_file, store.Snapshot.put
    monkeypatch.setattr(store, "save_file", lambda t, p: writes.append(p) or save(t, p))

    def spy(self, name, tensors=None, meta=None, *, copy=True):
        copies.append(copy)
        return put(self, name, tensors, meta, copy=copy)

    monkeypatch.setattr(store.Snapshot, "put", spy)
    settings = {**TINY, "num-server-rounds": 2, "method": method, "min-clients": 2}
    settings |= {"output-dir": str(tmp_path / "out"), "cache-dir": str(tmp_path / "cache")}
    run_app(settings, num_clients=2)
    assert len(writes) == 2 * 2  # rounds × clients
    assert copies == [False] * 4


def test_summary_times_and_counts_the_rounds_of_every_stage(tmp_path, monkeypatch):
    """summary.json ``round_seconds`` and ``bytes_per_round`` hold pre-training's rounds as well as
    fine-tuning's (they once kept only the stage that wrote last)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    run_dir = run_app(
        {
            **TINY,
            **MOCO,
            "method": "fedclf",
            "num-server-rounds": 2,
            "finetune-rounds": 2,
            "cache-dir": str(tmp_path / "cache"),
            "output-dir": str(tmp_path / "out"),
        }
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    timed = [(e["stage"], e["round"]) for e in summary["round_seconds"]]
    assert timed == [("pretrain", 1), ("pretrain", 2), ("finetune", 0), ("finetune", 1), ("finetune", 2)]
    assert all(e["seconds"] > 0 for e in summary["round_seconds"])
    counted = {(e["stage"], e["round"]): e for e in summary["bytes_per_round"]}
    assert list(counted) == [("pretrain", 1), ("pretrain", 2), ("finetune", 1), ("finetune", 2)]
    # 2 clients, each sent the global model and replying with its own (+ features in pre-training)
    assert all(e["messages"] == 4 and e["down"] > 0 and e["up"] > 0 for e in counted.values())
    # pre-training sends MoCo (query and key encoders) and the relayed features: more than the classifier
    assert counted[("pretrain", 1)]["down"] > counted[("finetune", 1)]["down"]
