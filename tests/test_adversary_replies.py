"""A malicious hospital's replies: every reply is screened, none ends the run, and Flower's robust
rules can replace the mean.

The run-level tests drive fedderm's ServerApp and ClientApps in this process
(``bench/loop_grid.py``) with one client, partition 2 of 3, whose replies are rewritten after its
ClientApp answered (:func:`poisoning`); a rejected reply must leave every round's global model
bit-identical to the run whose partition 2 fails outright, the run ``done``, and the client named
in the log and in ``summary.json``.  The unit tests hand crafted replies to the strategies.
"""

from __future__ import annotations

import json
import logging
import uuid

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum
from flwr.supercore.task_identity import TaskIdentity

import registry
import wire
from bench.loop_grid import TINY_RUN, run_app
from fedderm.config import ConfigError
from fedderm.results import RunRecorder
from strategies.common import cast_like

ATTACKER = 2  # the partition whose replies are rewritten (of 3)
RUN = {**TINY_RUN, "num-server-rounds": 2, "min-clients": 2, "tensorboard": False}


# -- helpers ---------------------------------------------------------------------------------------
def poisoning(rewrite=None, fail_train: bool = False):
    """fedderm's ClientApp with partition :data:`ATTACKER`'s replies passed through
    ``rewrite(instruction, reply, labelled)`` (``labelled``: every client's labelled images, from
    the handshake), or (``fail_train``) its train messages raising."""
    from client_app import app

    labelled: dict[int, int] = {}

    def call(msg: Message, context) -> Message:
        pid, kind = context.node_config["partition-id"], msg.metadata.message_type
        if fail_train and pid == ATTACKER and kind.startswith("train"):
            raise RuntimeError("partition 2 is down")
        reply = app(msg, context)
        if kind == "query.info" and not reply.has_error():
            labelled[pid] = int(reply.content["info"]["labelled"])
        if rewrite is not None and pid == ATTACKER and not reply.has_error():
            rewrite(msg, reply, labelled)
        return reply

    return call


def run(tmp_path, name: str, client_app, **extra):
    out = run_app({**RUN, "output-dir": str(tmp_path), "run-name": name, **extra}, 3, client_app=client_app)
    return out, json.loads((out / "summary.json").read_text())


def same_model(a, b) -> bool:
    wa, wb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def named(summary: dict, caplog, partition: int, words: str, rounds=(1, 2)) -> None:
    """``partition`` is in summary.json's ``missing_clients`` for every round of ``rounds``, rejected
    with ``words`` in the reason, and in a warning line with its node id."""
    entries = [m for m in summary.get("missing_clients", []) if m["partition-id"] == str(partition)]
    assert {m["round"] for m in entries} >= set(rounds), summary.get("missing_clients")
    assert all(m["reason"].startswith("rejected: ") and words in m["reason"] for m in entries), entries
    node = entries[0]["node-id"]
    assert f"client {partition} (node {node}) left out: rejected: " in caplog.text


@pytest.fixture(scope="module")
def honest_only(tmp_path_factory):
    """The run whose partition 2 fails every train message: the aggregate of the others alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (conftest.py): a module fixture comes before it
    try:
        out, summary = run(tmp_path_factory.mktemp("honest"), "honest", poisoning(fail_train=True))
    finally:
        torch.set_num_threads(threads)
    assert summary["status"] == "done"
    return out


@pytest.fixture
def task_identity():
    """What the ServerApp runtime sets before messages can be built."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 4242, SUPERLINK_NODE_ID
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def scaled(factor: float):
    """The attacker's update scaled: w_sent + factor · (w − w_sent)."""

    def rewrite(msg, reply, labelled):
        if not msg.metadata.message_type.startswith("train"):
            return
        sent, got = msg.content["arrays"], reply.content["arrays"]
        out = {}
        for key in got.keys():
            values = wire.values(got[key])
            if values.dtype.kind == "f":
                values = (wire.values(sent[key]) + factor * (values - wire.values(sent[key]))).astype(
                    values.dtype
                )
            out[key] = wire.to_array(np.require(values, requirements="C"))  # 0-d stays 0-d
        reply.content["arrays"] = ArrayRecord(out)

    return rewrite


def weight(value_of):
    """The attacker's train replies weighted ``value_of(labelled)``."""

    def rewrite(msg, reply, labelled):
        if msg.metadata.message_type.startswith("train"):
            reply.content["metrics"]["num-examples"] = value_of(labelled)

    return rewrite


def both(*rewrites):
    def rewrite(msg, reply, labelled):
        for r in rewrites:
            r(msg, reply, labelled)

    return rewrite


# -- the attacks of the table ----------------------------------------------------------------------
ATTACKS = {
    # 10**9 examples and its update x 1000: took over the global model
    "takeover": (
        both(scaled(1000.0), weight(lambda _: 10**9)),
        "labelled images it declared at the handshake",
    ),
    # NaN examples: a NaN global model, status done
    "nan": (weight(lambda _: float("nan")), "'num-examples' = nan is not a finite number"),
    # minus the others' examples: the weights sum to 0, ZeroDivisionError ended the run
    "cancel": (weight(lambda labelled: -sum(n for p, n in labelled.items() if p != ATTACKER)), "is below 1"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_poisoned_weight_is_rejected_and_the_model_is_the_others_alone(
    attack, tmp_path, honest_only, caplog
):
    rewrite, words = ATTACKS[attack]
    with caplog.at_level(logging.WARNING):
        out, summary = run(tmp_path, attack, poisoning(rewrite))
    assert summary["status"] == "done"
    assert same_model(out, honest_only)  # bit for bit: every round aggregated the other two alone
    named(summary, caplog, ATTACKER, words)
    assert "[!] 2 replies rejected by screening, of client(s) 2" in (out / "final_table.txt").read_text()


def test_an_evaluation_reply_claiming_another_partition_is_rejected(tmp_path, honest_only, caplog):
    """Partition 2 files its (perfect, made-up) evaluations under partition 0's id, in the val
    metrics riding in its train replies and in the final test: rejected, partition 0's rows are
    partition 0's own, and (its train replies rejected with them) the model is the others'."""
    fake = {"loss": 123.0, "balanced_accuracy": 1.0, "accuracy": 1.0, "partition-id": 0}

    def rewrite(msg, reply, labelled):
        for name in ("metrics", wire.VAL_METRICS):
            if name in reply.content and (
                name == wire.VAL_METRICS or msg.metadata.message_type == "evaluate"
            ):
                for key, value in fake.items():
                    reply.content[name][key] = value

    with caplog.at_level(logging.WARNING):
        out, summary = run(tmp_path, "spoof", poisoning(rewrite))
    assert summary["status"] == "done"
    rows = [m for r in summary["rounds"] for m in r["per_client"].values()] + list(
        summary["final"]["per_client"].values()
    )
    assert rows and all(m.get("loss") != 123.0 for m in rows)
    assert set(summary["final"]["per_client"]) == {"0", "1"}
    named(summary, caplog, ATTACKER, "claims partition-id 0")
    assert same_model(out, honest_only)


def test_a_malformed_scaffold_control_delta_is_rejected_and_the_run_goes_on(tmp_path, caplog):
    """SCAFFOLD's extra record, Δc_i of the wrong shape: before, c's update raised and ended the run."""

    def rewrite(msg, reply, labelled):
        if "control-delta" in reply.content:
            delta = dict(reply.content["control-delta"].items())
            key = next(iter(delta))
            delta[key] = wire.to_array(np.ones(7, np.float32))
            reply.content["control-delta"] = ArrayRecord(delta)

    with caplog.at_level(logging.WARNING):
        out, summary = run(tmp_path, "scaffold", poisoning(rewrite), method="scaffold")
    assert summary["status"] == "done"
    named(summary, caplog, ATTACKER, "control-delta: ")


def test_an_exception_while_aggregating_keeps_the_model_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    """Whatever screening misses: an exception in an overriding strategy's step (FedDyn's server
    update, made to raise in round 1) is logged and recorded, the round keeps its global model."""
    import strategies.feddyn as feddyn

    step, calls = feddyn.feddyn_server_step, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a reply the screening let through")
        return step(*args, **kwargs)

    monkeypatch.setattr(feddyn, "feddyn_server_step", flaky)
    with caplog.at_level(logging.ERROR):
        out, summary = run(tmp_path, "feddyn", poisoning(), method="feddyn")
    assert summary["status"] == "done" and len(calls) == 2
    (error,) = summary["aggregation_errors"]
    assert (
        error["round"] == 1
        and error["step"] == "aggregate_train"
        and "a reply the screening" in error["error"]
    )
    assert "train round 1: aggregate_train failed: ValueError" in caplog.text


# -- screening, unit by unit -----------------------------------------------------------------------
def fedavg(tmp_path, sizes=None, **config):
    """Flower's FedAvg with fedderm's Tracked, after a handshake with nodes 11, 12, 13 (partitions
    0, 1, 2; ``sizes``: their declared splits)."""
    from strategies.fedavg import build_strategy

    cfg = registry.load_config({"min-clients": 1, **config})
    recorder = RunRecorder(tmp_path / "run", cfg.method, cfg.to_flat())
    recorder.node_partitions = {11: 0, 12: 1, 13: 2}
    recorder.node_sizes = {
        n: dict(sizes or {"train": 50, "labelled": 40, "val": 10, "test": 10}) for n in (11, 12, 13)
    }
    strategy = build_strategy(cfg, recorder)
    strategy.sent = ArrayRecord({"w": Array(np.zeros(4, np.float32)), "n": Array(np.array(3, np.int64))})
    strategy._sent_to = [11, 12, 13]
    return strategy


def train_reply(node: int, w, n=10, pid=None, **metrics) -> Message:
    instr = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.asarray(w, np.float32)), "n": Array(np.array(4, np.int64))}),
            "metrics": MetricRecord(
                {
                    "num-examples": n,
                    "train_loss": 0.5,
                    "partition-id": node - 11 if pid is None else pid,
                    **metrics,
                }
            ),
        }
    )
    return Message(content, reply_to=instr)


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (10**9, "exceeds the 40 labelled images it declared"),
        (41, "exceeds the 40"),
        (float("nan"), "not a finite number"),
        (float("inf"), "not a finite number"),
        (-30, "below 1"),
        (0, "below 1"),
        (2.5, "not an integer"),
        ([1, 2], "is list [1, 2], expected one integer"),
    ],
)
def test_num_examples_must_be_a_count_up_to_what_the_client_declared(n, words, tmp_path, task_identity):
    strategy = fedavg(tmp_path)
    good = lambda: [train_reply(11, [1, 1, 1, 1]), train_reply(12, [3, 3, 3, 3], n=30)]  # noqa: E731
    alone, _ = fedavg(tmp_path).aggregate_train(1, good())
    arrays, _ = strategy.aggregate_train(1, [*good(), train_reply(13, [9, 9, 9, 9], n=n)])
    assert all(np.array_equal(arrays[k].numpy(), alone[k].numpy()) for k in alone.keys())
    strategy.record_notes()
    (missing,) = strategy.recorder.extra["missing_clients"]
    assert missing["partition-id"] == "2" and missing["node-id"] == 13 and words in missing["reason"]


def test_train_metrics_claims_and_records_are_screened(tmp_path, task_identity):
    strategy = fedavg(tmp_path)
    bad = {
        12: train_reply(12, [1, 1, 1, 1], train_loss=float("inf")),
        13: train_reply(13, [1, 1, 1, 1], pid=0),
        14: train_reply(14, [1, 1, 1, 1], pid=3),  # not met at the handshake
    }
    extra = train_reply(11, [1, 1, 1, 1])
    extra.content["smuggled"] = ArrayRecord({"x": Array(np.ones(2, np.float32))})
    strategy._sent_to = [11, 12, 13, 14]
    assert strategy.aggregate_train(1, [extra, *bad.values()]) == (None, None)  # none left: model kept
    strategy.record_notes()
    reasons = {m["node-id"]: m["reason"] for m in strategy.recorder.extra["missing_clients"]}
    assert "records the method does not send: ['smuggled']" in reasons[11]
    assert "metric 'train_loss' = inf" in reasons[12]
    assert "claims partition-id 0; the handshake gave node 13 partition 2" in reasons[13]
    assert "node 14 did not answer the handshake" in reasons[14]


def test_max_update_norm_rejects_an_update_further_than_the_bound(tmp_path, task_identity):
    strategy = fedavg(tmp_path, **{"max-update-norm": 1.0})
    strategy._sent_to = [11, 12]
    near, far = train_reply(11, [0.5, 0.5, 0.5, 0.5]), train_reply(12, [0.5, 0.5, 0.5, 0.6])  # 1.0, 1.04
    arrays, _ = strategy.aggregate_train(1, [near, far])
    assert np.array_equal(arrays["w"].numpy(), np.full(4, 0.5, np.float32))
    strategy.record_notes()
    (missing,) = strategy.recorder.extra["missing_clients"]
    assert missing["node-id"] == 12 and "L2 norm 1.054 exceeds max-update-norm = 1" in missing["reason"]
    with pytest.raises(ConfigError, match="'max-update-norm'"):
        registry.load_config({"max-update-norm": -1.0})


def evaluate_reply(node: int, split_size=10, pid=None, cm=None, **metrics) -> Message:
    instr = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="evaluate")
    values = {
        "loss": 0.7,
        "balanced_accuracy": 0.6,
        "accuracy": 0.6,
        "num-examples": split_size,
        "confusion-matrix": cm if cm is not None else [4, 1, 3, 2],
        "partition-id": node - 11 if pid is None else pid,
        **metrics,
    }
    return Message(RecordDict({"metrics": MetricRecord(values)}), reply_to=instr)


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (dict(balanced_accuracy=5.0), "'balanced_accuracy' = 5.0 is outside [0, 1]"),
        (dict(loss=-1.0), "'loss' = -1.0 is not a number >= 0"),
        (
            dict(cm=[4.0, 1.0, 3.0, float("nan")]),
            "'confusion-matrix' holds counts that are not integers >= 0",
        ),
        (dict(split_size=11), "exceeds the 10 images of that split"),
        (dict(cm=[4, 1, 3, 1]), "counts 9 images, 'num-examples' 10"),
        (dict(cm=[4, 1, 3, 1, 1]), "has 5 cells, expected 2×2"),
        (dict(pid=0), "claims partition-id 0"),
        (dict(auc=float("inf")), "'auc' = inf is not a finite number"),
    ],
)
def test_evaluation_replies_are_screened_and_filed_under_the_handshakes_partition(
    reply, words, tmp_path, task_identity
):
    strategy = fedavg(tmp_path)
    strategy.recorder.set_classes(["a", "b"])
    strategy._eval_sent_to = [11, 12, 13]
    replies = [evaluate_reply(11, auc=float("nan")), evaluate_reply(12), evaluate_reply(13, **reply)]
    strategy.aggregate_evaluate(0, replies)
    assert set(strategy.evaluated) == {"0", "1"}  # a one-class AUC (NaN) is a value, not a fault
    strategy.record_notes()
    (missing,) = strategy.recorder.extra["missing_clients"]
    assert missing["node-id"] == 13 and words in missing["reason"], missing


def test_a_malformed_pr_curve_is_rejected_before_it_is_drawn(tmp_path, task_identity):
    from strategies.flbt import build_strategy

    cfg = registry.load_config({"method": "flbt", "min-clients": 1})
    recorder = RunRecorder(tmp_path / "run", "flbt", cfg.to_flat())
    recorder.node_partitions, recorder.node_sizes = (
        {11: 0, 12: 1},
        {n: {"train": 9, "labelled": 9, "val": 10, "test": 10} for n in (11, 12)},
    )
    recorder.set_classes(["a", "b"])
    strategy = build_strategy(cfg, recorder)
    strategy.classes, strategy.split, strategy._eval_sent_to = ["a", "b"], "test", [11, 12]
    curve = {"ap-0": 0.5, "precision-0": [1.0, 0.5], "recall-0": [0.0, 1.0]}
    replies = [evaluate_reply(11), evaluate_reply(12)]
    replies[0].content[wire.PR_CURVE] = ConfigRecord(curve)
    replies[1].content[wire.PR_CURVE] = ConfigRecord({**curve, "recall-0": ["not", "numbers"]})
    strategy.aggregate_evaluate(3, replies)
    strategy.record_evaluation(3, strategy.evaluated)
    assert sorted(p.name for p in recorder.run_dir.glob("pr_curve_client*.png")) == ["pr_curve_client0.png"]
    strategy.record_notes()
    (missing,) = recorder.extra["missing_clients"]
    assert missing["node-id"] == 12 and "pr-curve 'recall-0'" in missing["reason"]


def test_a_handshake_reply_that_does_not_add_up_keeps_its_node_out(tmp_path, task_identity, caplog):
    """``query.info`` is screened too: a node declaring more labelled than training images (to be
    allowed a large weight later), or sending no sizes, takes no part in the run."""
    import server_app

    cfg = registry.load_config({"min-clients": 2})
    good = {
        "classes": ["a", "b"], "partition-id": 0, "train": 40, "labelled": 20, "val": 10, "test": 10,
        "skipped-files": 0, "torch": "2", "torch-threads": 1, "device": "cpu",
        "class-counts": [30, 30], "counts-train": [20, 20],
    }  # fmt: skip
    infos = {
        11: good,
        12: {**good, "partition-id": 1},
        13: {**good, "partition-id": 2, "labelled": 10**9},
        14: {k: v for k, v in good.items() if k != "train"} | {"partition-id": 3},
    }
    grid = Scripted(lambda msg: RecordDict({"info": ConfigRecord(infos[msg.metadata.dst_node_id])}))
    with caplog.at_level(logging.WARNING):
        met = server_app.meet_clients(grid, list(infos), cfg)
    assert sorted(met) == [11, 12]
    assert "node 13: handshake reply rejected: 'labelled' = 1000000000 exceeds 'train' = 40" in caplog.text
    assert "node 14: handshake reply rejected: no 'train'" in caplog.text


class Scripted:
    """A grid whose nodes answer with ``content_of(message)`` (a RecordDict, or None: no reply)."""

    def __init__(self, content_of, nodes=()):
        self.content_of, self.nodes, self.sent = content_of, list(nodes), []

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as Flower's grids on push
            self.sent.append(msg)
            content = self.content_of(msg)
            if content is not None:
                out.append(Message(content, reply_to=msg))
        return out


def test_a_global_test_reply_of_another_size_is_rejected(tmp_path, task_identity):
    """Every client evaluates the one global test set: a size most clients do not report is
    rejected (before, the clients' sizes differing stopped the run at its very end)."""
    from strategies.globaltest import global_test

    strategy = fedavg(tmp_path, **{"test-set": "global", "min-clients": 3})
    strategy.recorder.set_classes(["a", "b"])
    sizes = {11: 10, 12: 10, 13: 11}

    def content_of(msg):
        node = msg.metadata.dst_node_id
        return evaluate_reply(node, split_size=sizes[node], cm=[4, 1, 3, sizes[node] - 8]).content

    global_test(strategy, Scripted(content_of, [11, 12, 13]), ArrayRecord(), 2)
    final = strategy.recorder.final
    assert final["num-examples"] == 10 and set(final["global_test"]["per_client"]) == {"0", "1"}
    strategy.record_notes()
    (missing,) = strategy.recorder.extra["missing_clients"]
    assert (
        missing["node-id"] == 13
        and "global test set of 11 images; 2 of 3 clients evaluated 10" in missing["reason"]
    )


def test_local_training_files_each_reply_under_its_nodes_partition(tmp_path, task_identity):
    """``local`` (no aggregation) records every client's own rows: a reply claiming another
    client's partition is rejected, not written over that client's row."""
    from strategies.local import _ask

    cfg = registry.load_config({"method": "local", "min-clients": 1})
    recorder = RunRecorder(tmp_path / "run", "local", cfg.to_flat())
    recorder.node_partitions = {11: 0, 12: 1}
    recorder.node_sizes = {n: {"train": 9, "labelled": 9, "val": 10, "test": 10} for n in (11, 12)}
    fake = {11: 0.6, 12: 0.9}

    def content_of(msg):
        node = msg.metadata.dst_node_id
        return evaluate_reply(node, pid=0, accuracy=fake[node]).content

    per_client, good = _ask(Scripted(content_of), [11, 12], "evaluate", 1, "val", recorder=recorder)
    assert list(per_client) == ["0"] and per_client["0"]["accuracy"] == 0.6
    (missing,) = recorder.extra["missing_clients"]
    assert missing["node-id"] == 12 and "claims partition-id 0" in missing["reason"]


def test_a_bad_sift_hop_is_skipped_and_the_ring_goes_on(tmp_path, task_identity):
    """SiFT's ring passes each reply on to the next client: a NaN pair, or one of the wrong shape,
    is skipped (the next hop gets the pair from before it) and recorded."""
    from strategies.sift import LONG, SHORT, SiftStrategy

    cfg = registry.load_config({"method": "sift", "min-clients": 1})
    recorder = RunRecorder(tmp_path / "run", "sift", cfg.to_flat())
    recorder.node_partitions = {11: 0, 12: 1, 13: 2}
    recorder.node_sizes = {n: {"train": 9, "labelled": 9, "val": 3, "test": 3} for n in (11, 12, 13)}
    strategy = SiftStrategy(cfg=cfg, recorder=recorder, min_train_nodes=1, min_available_nodes=1)

    def content_of(msg):
        node, pair = msg.metadata.dst_node_id, {k: msg.content[k] for k in (SHORT, LONG)}
        step = {11: 1.0, 12: float("nan"), 13: 1.0}[node]
        moved = {
            k: ArrayRecord({"w": Array((wire.values(r["w"]) + step).astype(np.float32))})
            for k, r in pair.items()
        }
        return RecordDict({**moved, "metrics": MetricRecord({"num-examples": 9, "partition-id": node - 11})})

    start = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    strategy.configure_train(1, start, ConfigRecord(), Scripted(content_of, [11, 12, 13]))
    assert np.array_equal(strategy.inference_model(strategy.pair)["w"].numpy(), np.full(3, 2.0, np.float32))
    strategy.record_notes()
    (missing,) = recorder.extra["missing_clients"]
    assert missing["node-id"] == 12 and "short: 'w' holds non-finite values" in missing["reason"]
    assert recorder.extra["ring"][0]["visited"] == [0, 2]


def test_pseudo_images_are_screened_and_filed_under_the_handshakes_partition(tmp_path, task_identity):
    """SSL-FL-BT's stage 1: a centre's pseudo images of the wrong dtype, or more than
    ``ssl.pseudo-per-centre``, are left out; the others make the pre-training set."""
    from strategies.ssl_flbt import collect_pseudo_images

    cfg = registry.load_config(
        {"method": "ssl-flbt", "min-clients": 2, "image-size": 8, "ssl.pseudo-per-centre": 4}
    )
    recorder = RunRecorder(tmp_path / "run", "ssl-flbt", cfg.to_flat())
    recorder.node_partitions = {11: 0, 12: 1, 13: 2, 14: 3}
    images = {
        11: np.full((4, 3, 8, 8), 1, np.uint8),
        12: np.full((4, 3, 8, 8), 2, np.uint8),
        13: np.full((4, 3, 8, 8), 3, np.float32),
        14: np.full((5, 3, 8, 8), 4, np.uint8),
    }

    def content_of(msg):
        node = msg.metadata.dst_node_id
        metrics = {"num-examples": len(images[node]), "partition-id": node - 11}
        return RecordDict(
            {wire.PSEUDO: ArrayRecord({wire.PSEUDO: Array(images[node])}), "metrics": MetricRecord(metrics)}
        )

    got, centres, info = collect_pseudo_images(
        Scripted(content_of), [11, 12, 13, 14], cfg=cfg, recorder=recorder
    )
    assert sorted(info) == ["0", "1"] and got.shape == (8, 3, 8, 8)
    assert torch.equal(
        got[centres == 0], torch.ones(4, 3, 8, 8, dtype=torch.uint8)
    )  # partition 0 is node 11's
    reasons = {m["node-id"]: m["reason"] for m in recorder.extra["missing_clients"]}
    assert "pseudo images float32[4, 3, 8, 8]" in reasons[13] and "uint8[1..4, 3, 8, 8]" in reasons[14]


def test_fedclf_relay_metrics_are_screened(tmp_path, task_identity):
    """FedCLF reads counts out of the replies' metrics (privacy accounting): a NaN there raised
    while aggregating and ended the run."""
    from strategies.fedclf import build_strategy

    cfg = registry.load_config({"method": "fedclf", "min-clients": 1, "fedclf.queue-size": 8})
    recorder = RunRecorder(tmp_path / "run", "fedclf", cfg.to_flat())
    strategy = build_strategy(cfg, recorder)
    strategy.sent, strategy._sent_to = ArrayRecord({"w": Array(np.zeros(2, np.float32))}), [11, 12]

    def reply(node, releases):
        instr = Message(
            RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train.pretrain"
        )
        metrics = {"num-examples": 4, "partition-id": node - 11, "relay-releases": releases}
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({"w": Array(np.ones(2, np.float32))}),
                    "features": ArrayRecord({"features": Array(np.ones((3, 128), np.float16))}),
                    "metrics": MetricRecord(metrics),
                }
            ),
            reply_to=instr,
        )

    arrays, _ = strategy.aggregate_train(1, [reply(11, 2), reply(12, float("nan"))])
    assert arrays is not None and set(strategy.uploads) == {0}
    strategy.record_notes()
    (missing,) = recorder.extra["missing_clients"]
    assert missing["node-id"] == 12 and "'relay-releases' = nan" in missing["reason"]


def test_a_probe_reply_claiming_another_partition_is_rejected(tmp_path, task_identity):
    from strategies.probe import probe_round

    cfg = registry.load_config({"method": "fedsimclr", "min-clients": 1, "probe-every": 1})
    recorder = RunRecorder(tmp_path / "run", "fedsimclr", cfg.to_flat())
    recorder.node_partitions = {11: 0, 12: 1}
    recorder.node_sizes = {n: {"train": 9, "labelled": 9, "val": 5, "test": 3} for n in (11, 12)}

    def content_of(msg):
        node = msg.metadata.dst_node_id
        metrics = {f"{k}.balanced_accuracy": 0.5 + 0.5 * (node == 12) for k in ("knn", "linear")}
        return RecordDict(
            {"metrics": MetricRecord({**metrics, "num-examples": 5, "labelled": 9, "partition-id": 0})}
        )

    means = probe_round(Scripted(content_of, [11, 12]), cfg, recorder, 1, ArrayRecord())
    assert means["knn"]["balanced_accuracy"] == 0.5  # node 12's 1.0, filed as partition 0, is not in it
    (missing,) = recorder.extra["missing_clients"]
    assert missing["node-id"] == 12 and "claims partition-id 0" in missing["reason"]


def test_scaffold_rejects_a_malformed_control_delta_bit_identically(tmp_path, task_identity):
    """The other replies' model and control variate, bit for bit, as if the bad reply never came."""
    from strategies.scaffold import DELTA, ScaffoldStrategy

    def strategy():
        cfg = registry.load_config({"method": "scaffold", "min-clients": 1})
        s = ScaffoldStrategy(
            cfg=cfg, recorder=RunRecorder(tmp_path / str(uuid.uuid4()), "scaffold", cfg.to_flat())
        )
        s.sent, s._sent_to = ArrayRecord({"w": Array(np.zeros(3, np.float32))}), [11, 12, 13]
        s.num_sampled = 3
        return s

    def reply(node, w, delta):
        instr = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(np.asarray(w, np.float32))}),
                DELTA: ArrayRecord({"w": Array(np.asarray(delta, np.float32))}),
                "metrics": MetricRecord({"num-examples": 5, "partition-id": node - 11}),
            }
        )
        return Message(content, reply_to=instr)

    good = lambda: [reply(11, [1, 2, 3], [0.1, 0.2, 0.3]), reply(12, [3, 2, 1], [0.3, 0.1, 0.2])]  # noqa: E731
    ours, alone = strategy(), strategy()
    arrays, _ = ours.aggregate_train(1, [*good(), reply(13, [9, 9, 9], [1.0, 1.0])])
    reference, _ = alone.aggregate_train(1, good())
    assert np.array_equal(arrays["w"].numpy(), reference["w"].numpy())
    assert np.array_equal(ours.control["w"].numpy(), alone.control["w"].numpy())


# -- robust aggregation ----------------------------------------------------------------------------
RULES = {
    "median": lambda f: FedMedian(),
    "trimmed-mean": lambda f: FedTrimmedAvg(beta=0.2),
    "krum": lambda f: Krum(num_malicious_nodes=f),
    "multi-krum": lambda f: MultiKrum(num_malicious_nodes=f, num_nodes_to_select=6),
    "bulyan": lambda f: Bulyan(num_malicious_nodes=f),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_robust_rules_compute_what_flowers_strategies_compute(rule, tmp_path, task_identity):
    """Seven replies, one of them an update x 100: fedderm's aggregate is the bits of Flower's
    strategy for the rule (its integer buffers cast back), and lies nearer the honest mean than
    the mean of all seven does."""
    rng = np.random.default_rng(3)
    ws = [rng.normal(size=4).astype(np.float32) for _ in range(7)]
    ws[6] = (100 * ws[6]).astype(np.float32)
    ns = [10, 20, 30, 40, 25, 15, 40]

    def replies():
        return [train_reply(11 + i, w, n=n, pid=None) for i, (w, n) in enumerate(zip(ws, ns))]

    strategy = fedavg(tmp_path, aggregation=rule, **{"min-clients": 7, "byzantine-clients": 1})
    strategy.recorder.node_partitions = {11 + i: i for i in range(7)}
    strategy.recorder.node_sizes = {
        11 + i: {"train": 50, "labelled": 40, "val": 5, "test": 5} for i in range(7)
    }
    strategy._sent_to = list(range(11, 18))
    ours, _ = strategy.aggregate_train(1, replies())
    flowers, _ = RULES[rule](1).aggregate_train(1, [pop_partition(r) for r in replies()])
    flowers = cast_like(flowers, strategy.sent)
    for key in flowers.keys():
        assert ours[key].dtype == flowers[key].dtype and np.array_equal(
            ours[key].numpy(), flowers[key].numpy()
        )
    honest = np.average(np.stack(ws[:6]), axis=0, weights=ns[:6])
    everyone = np.average(np.stack(ws), axis=0, weights=ns)
    assert np.linalg.norm(ours["w"].numpy() - honest) < np.linalg.norm(everyone - honest) / 5


def pop_partition(msg: Message) -> Message:
    """``msg`` without its ``partition-id`` (fedderm files it away before aggregating)."""
    msg.content["metrics"].pop("partition-id")
    return msg


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            {"aggregation": "median", "min-clients": 2},
            "'min-clients' = 2 is too few for aggregation = 'median'",
        ),
        ({"aggregation": "krum", "min-clients": 4}, "it needs 5"),
        ({"aggregation": "bulyan", "min-clients": 6}, "it needs 7"),
        ({"aggregation": "bulyan", "min-clients": 10, "byzantine-clients": 2}, "it needs 11"),
        (
            {"aggregation": "trimmed-mean", "min-clients": 4},
            "'trimmed-mean-beta' = 0.2 cuts int(0.2 x min-clients = 4) = 0",
        ),
        ({"aggregation": "multi-krum", "min-clients": 5, "multi-krum-select": 5}, "'multi-krum-select' = 5"),
        (
            {"aggregation": "median", "min-clients": 3, "method": "scaffold"},
            "does not apply to method 'scaffold'",
        ),
        (
            {"aggregation": "median", "min-clients": 3, "method": "feddyn"},
            "does not apply to method 'feddyn'",
        ),
        ({"aggregation": "median", "min-clients": 3, "method": "sift"}, "does not apply to method 'sift'"),
        ({"aggregation": "median", "min-clients": 3, "method": "local"}, "does not apply to method 'local'"),
        (
            {"aggregation": "median", "min-clients": 3, "method": "localcl"},
            "does not apply to method 'localcl'",
        ),
        ({"aggregation": "median", "min-clients": 3, "dp.mode": "server"}, "does not combine with dp.mode"),
        ({"aggregation": "average"}, "'aggregation' must be one of"),
    ],
)
def test_robust_rules_are_checked_before_the_run(config, words):
    with pytest.raises(ConfigError) as err:
        registry.load_config(config)
    assert words in str(err.value)


def test_robust_rules_take_the_methods_that_average_one_model(tmp_path):
    for config in (
        {"aggregation": "median", "min-clients": 3, "method": m}
        for m in ("fedavg", "fedprox", "fedbn", "fedmae", "fedclf")
    ):
        assert registry.load_config(config).aggregation == "median"
    assert registry.load_config({"aggregation": "trimmed-mean", "min-clients": 5}).trimmed_mean_beta == 0.2
