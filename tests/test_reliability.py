"""Reliability: resume after a crash, dropped clients, rejected updates, bad data."""

import json
import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from PIL import Image

import registry
import sim
import strategies.common as common
from fedderm.data import DataError, load_client_data
from fedderm.results import RunRecorder
from strategies.fedavg import build_strategy

SMALL = {
    "model": "tiny-cnn",
    "image-size": 32,
    "synthetic-per-class": 20,
    "local-epochs": 1,
    "batch-size": 16,
}


class Killed(Exception):
    """Stands for the server process dying."""


def test_resume_after_a_crash_equals_an_uninterrupted_run(in_process, tmp_path, monkeypatch):
    base = {**SMALL, "num-server-rounds": 3, "cache-dir": str(tmp_path / "cache")}
    full = sim.simulate({**base, "output-dir": str(tmp_path / "a"), "run-name": "full"})

    save = common.save_checkpoint

    def save_then_die(run_dir, stage, server_round, payload, keep=3):
        path = save(run_dir, stage, server_round, payload, keep)
        if server_round == 2:
            raise Killed("server killed after round 2")
        return path

    monkeypatch.setattr(common, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        sim.simulate({**base, "output-dir": str(tmp_path / "b"), "run-name": "crashed"})
    crashed = tmp_path / "b" / "crashed"
    assert (crashed / "checkpoint-round-2.pt").exists() and not (crashed / "model.pt").exists()

    monkeypatch.setattr(common, "save_checkpoint", save)
    resumed = sim.simulate({"resume": str(crashed)})
    assert resumed == crashed
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, resumed))
    assert a["final"] == b["final"] and a["rounds"] == b["rounds"] and a["best_round"] == b["best_round"]
    wa, wb = torch.load(full / "model.pt"), torch.load(resumed / "model.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert len(list(crashed.glob("checkpoint-round-*.pt"))) == 2  # rounds 2, 3 (keep-checkpoints=2)


def _strategy(tmp_path, min_clients=1):
    cfg = registry.load_config({"min-clients": min_clients})
    return build_strategy(cfg, RunRecorder(tmp_path, "fedavg", cfg.to_flat()))


def _reply(instruction, weights, pid):
    return Message(
        RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in weights.items()}),
                "metrics": MetricRecord({"num-examples": 10, "partition-id": pid}),
            }
        ),
        reply_to=instruction,
    )


def test_nan_and_wrong_shape_updates_are_rejected_and_logged(tmp_path, caplog):
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    strategy = _strategy(tmp_path)
    strategy.recorder.node_partitions = {11: 0, 12: 1, 13: 2}
    global_w = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    sent = ArrayRecord({k: Array(v) for k, v in global_w.items()})
    strategy.sent, strategy._sent_to = sent, [11, 12, 13]
    instr = {
        n: Message(RecordDict({"config": ConfigRecord()}), dst_node_id=n, message_type="train")
        for n in (11, 12, 13)
    }
    good = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}
    nan = {"w": np.full((2, 3), np.nan, np.float32), "b": np.ones(3, np.float32)}
    shape = {"w": np.ones((3, 2), np.float32), "b": np.ones(3, np.float32)}
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(
            1, [_reply(instr[11], good, 0), _reply(instr[12], nan, 1), _reply(instr[13], shape, 2)]
        )
    assert np.array_equal(arrays["w"].numpy(), good["w"])  # only the valid update is averaged
    assert all(np.isfinite(a.numpy()).all() for a in arrays.values())
    text = caplog.text
    assert "client 1 (node 12) left out: rejected: 'w' holds non-finite values" in text
    assert "client 2 (node 13) left out: rejected: 'w' is float32[3, 2], expected float32[2, 3]" in text
    strategy.record_notes()  # the round loop's record step
    strategy.recorder.flush()  # summary.json is written when the run ends (rounds.jsonl as they come)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {m["partition-id"] for m in summary["missing_clients"]} == {"1", "2"}


def test_too_few_replies_keep_the_global_model(tmp_path):
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    strategy = _strategy(tmp_path, min_clients=2)
    strategy.sent = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    strategy._sent_to = [11, 12]
    instr = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=11, message_type="train")
    arrays, metrics = strategy.aggregate_train(1, [_reply(instr, {"w": np.ones(2, np.float32)}, 0)])
    assert arrays is None and metrics is None


def _folder_with_a_corrupt_image(root, size=40):
    rng = np.random.default_rng(0)
    for c, cls in enumerate(["benign", "malignant"]):
        (root / cls).mkdir(parents=True)
        for i in range(12):
            img = (rng.integers(0, 60, (size, size, 3)) + 150 * c).astype(np.uint8)
            Image.fromarray(img).save(root / cls / f"{i}.png")
    (root / "malignant" / "broken.png").write_bytes(b"not a png")
    return root


def test_bad_file_is_named_with_the_client_or_skipped_and_counted(in_process, tmp_path):
    data = _folder_with_a_corrupt_image(tmp_path / "data")
    base = {
        **SMALL,
        "dataset": "folder",
        "data-path": str(data),
        "partition": "iid",
        "num-server-rounds": 1,
        "output-dir": str(tmp_path / "out"),
        "cache-dir": str(tmp_path / "c"),
    }
    with pytest.raises(Exception) as err:
        sim.simulate(base)
    # the shared pool is checked before Ray starts: the error names the file and how to skip it
    assert "broken.png" in str(err.value) and "skip-bad-files" in str(err.value)
    run_dir = sim.simulate({**base, "skip-bad-files": True})
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_files"] == {"0": 1, "1": 1}  # the shared pool skipped one file


def test_empty_partition_names_the_client(monkeypatch, tmp_path):
    import fedderm.data as data

    cfg = registry.load_config({**SMALL, "cache-dir": str(tmp_path)})
    monkeypatch.setattr(data, "partition_indices", lambda *a, **k: [np.arange(5), np.array([], np.int64)])
    with pytest.raises(DataError, match="client 1 has an empty partition"):
        load_client_data(cfg, 1, 2)


def test_aggregation_keeps_integer_buffers_integer(tmp_path):
    """Flower averages in float64; BatchNorm's num_batches_tracked must stay int64 so that the
    next round's replies still match the global model."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    strategy = _strategy(tmp_path)
    sent = {"w": np.zeros(2, np.float32), "n": np.array(4, np.int64)}
    strategy.sent = ArrayRecord({k: Array(v) for k, v in sent.items()})
    strategy._sent_to = [11, 12]
    instr = {
        n: Message(RecordDict({"config": ConfigRecord()}), dst_node_id=n, message_type="train")
        for n in (11, 12)
    }
    arrays, _ = strategy.aggregate_train(
        1,
        [
            _reply(instr[11], {"w": np.ones(2, np.float32), "n": np.array(6)}, 0),
            _reply(instr[12], {"w": np.zeros(2, np.float32), "n": np.array(8)}, 1),
        ],
    )
    assert arrays["n"].dtype == "int64" and int(arrays["n"].numpy()) == 7
    assert arrays["w"].dtype == "float32" and np.allclose(arrays["w"].numpy(), 0.5)


def test_a_dead_nodes_superlink_error_reply_is_recorded_against_that_node(tmp_path, caplog):
    """Flower answers a message to a SuperNode that died with an error reply whose source is the
    SuperLink (node 1): it is matched to its node by ``reply_to_message_id``, with Flower's reason,
    and that node is not also reported silent."""
    from fake_grid import FakeGrid
    from flwr.common.constant import SUPERLINK_NODE_ID

    from fedderm.models import create_model

    rc = {**SMALL, "num-server-rounds": 1, "cache-dir": str(tmp_path / "cache")}
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, {11: 0, 7: 1, 30: 2}, fail={1: "dead"})
    recorder = RunRecorder(tmp_path / "run", "fedavg", cfg.to_flat())
    recorder.node_partitions = dict(grid.partition_of_node)  # what the handshake fills in
    strategy = build_strategy(cfg, recorder)
    model = create_model("tiny-cnn", 5, 32)
    with caplog.at_level(logging.WARNING):
        common.run_rounds(strategy, grid, ArrayRecord(model.state_dict()), evaluate=False)
    dead = [r for r in grid.replies if r.has_error()]
    assert [r.metadata.src_node_id for r in dead] == [SUPERLINK_NODE_ID]  # as Flower sends it
    missing = recorder.extra["missing_clients"]
    assert [(m["round"], m["partition-id"], m["node-id"]) for m in missing] == [(1, "1", 7)]
    assert missing[0]["reason"].startswith("failed: Error: Node Unavailable")
    assert "client 1 (node 7) left out: failed: Error: Node Unavailable" in caplog.text
    assert "node 1)" not in caplog.text and "round-timeout" not in caplog.text
    assert set(strategy.train_per_client) == {"0", "2"}


def test_the_clients_left_out_of_a_step_that_fails_still_reach_the_results(tmp_path):
    """Hooks only note the clients they leave out; the round loop records them, also when a step
    fails after screening: every client fails its evaluate messages, so the global test raises,
    and summary.json still names each client with its reason for every step, the global test's
    included."""
    from fake_grid import FakeGrid

    from fedderm.models import create_model

    rc = {**SMALL, "num-server-rounds": 1, "test-set": "global", "cache-dir": str(tmp_path / "cache")}
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, {11: 0, 12: 1}, fail={0: "raise-evaluate", 1: "raise-evaluate"})
    recorder = RunRecorder(tmp_path / "run", "fedavg", cfg.to_flat())
    recorder.node_partitions = dict(grid.partition_of_node)
    strategy = build_strategy(cfg, recorder)
    with pytest.raises(RuntimeError, match="no client returned metrics on the global test set"):
        common.run_federated(strategy, grid, ArrayRecord(create_model("tiny-cnn", 5, 32).state_dict()))
    recorder.close()  # as the ServerApp does when a run ends, also in failure
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    left_out = [(m["round"], m["partition-id"]) for m in summary["missing_clients"]]
    # round 1's val (round 0's rode in the train message), the test and the global test, whose
    # failure ended the run
    assert left_out == [(1, "0"), (1, "1")] * 3
    assert all(m["reason"] == "failed: RuntimeError('injected failure')" for m in summary["missing_clients"])
