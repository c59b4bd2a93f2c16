"""Single-centre training (the "ResNet50" baseline of paper 004 Tables II-IV): no aggregation,
nothing uploaded but metrics.  Every round each client trains its own model and evaluates it
on its own validation split; the final test uses each client's own best-on-val model
(``clients.local``).  The server only drives the rounds and records the per-client results, so
the mean row is the GTA of single-centre models.  Like every method it checkpoints each round (the
results so far; the models are client state) and continues from there with ``resume``."""

from __future__ import annotations

import time
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from fedderm.checkpoint import DEFAULT_STAGE, latest_checkpoint
from fedderm.metrics import mean_over_clients
from fedderm.models import create_model
from fedderm.results import client_sort_key
from wire import PR_CURVE

from . import progress
from .common import save_round
from .flbt_family import save_pr_curves
from .nodes import SentTo
from .recording import record_missing
from .screening import count_problem, evaluation_problem, metrics_problem, partition_problem, pr_curve_problem


def _ask(
    grid: Grid,
    node_ids: list[int],
    kind: str,
    server_round: int,
    split: str | None = None,
    arrays: ArrayRecord | None = None,
    timeout: float = 3600,
    recorder=None,
) -> tuple[dict, list[tuple[str, Message]]]:
    """Send ``kind`` to every node and wait; returns the per-client metrics by partition id and the
    ``(partition id, reply)`` pairs.  A failed or missing reply stops the run; a reply that fails
    screening (:func:`screened`) is left out, logged and recorded."""
    config = ConfigRecord({"server-round": server_round, **({"split": split} if split else {})})
    msgs = []
    for nid in node_ids:
        content = RecordDict({"config": ConfigRecord(dict(config))})
        if arrays is not None:
            content["arrays"] = arrays
        msgs.append(Message(content, dst_node_id=nid, message_type=kind))
    sent = SentTo(msgs)  # a dead node's error reply comes from the SuperLink: map by message id
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    errors = [f"node {sent.node_of(r)}: {r.error.reason}" for r in replies if r.has_error()]
    if errors or len(replies) < len(node_ids):
        raise RuntimeError(
            f"local: {kind} round {server_round} failed on {len(node_ids) - len(replies) + len(errors)} "
            "client(s):\n  " + "\n  ".join(errors or ["(no reply before the timeout)"])
        )
    good = screened(recorder, kind, server_round, split, replies, sent)
    per_client = {}
    for pid, r in good:
        metrics = dict(r.content["metrics"])
        metrics.pop("partition-id", None)
        per_client[pid] = metrics
    return dict(sorted(per_client.items(), key=lambda kv: client_sort_key(kv[0]))), good


def screened(recorder, kind: str, server_round: int, split: str | None, replies: list[Message], sent: SentTo):
    """``(partition id, reply)`` of the replies fit to record, the partition id the one the handshake
    gave the node; the others are logged and recorded (``missing_clients``).  Train replies: finite
    metrics, ``num-examples`` at most the labelled images declared; evaluation replies: an
    evaluation's metrics (:func:`~strategies.screening.evaluation_problem`) and PR curves."""
    known = recorder.node_partitions if recorder is not None else {}
    sizes = recorder.node_sizes if recorder is not None else {}
    names = ((recorder.classes if recorder is not None else None) or {}).get("names")
    good, missing = [], []
    for r in replies:
        node = sent.node_of(r)
        metrics = r.content.metric_records.get("metrics")
        declared = sizes.get(node, {})
        if metrics is None:
            problem = "no 'metrics' MetricRecord"
        elif problem := partition_problem(node, metrics, known):
            pass
        elif kind == "train":
            problem = metrics_problem(metrics) or count_problem(
                "num-examples",
                metrics.get("num-examples"),
                declared.get("labelled"),
                declared="labelled images it declared at the handshake",
            )
        else:
            most = declared.get(split) if split in ("val", "test") else None
            problem = evaluation_problem(metrics, most, len(names) if names else None)
            if problem is None and PR_CURVE in r.content:
                curves = r.content.config_records.get(PR_CURVE)
                problem = (
                    f"{PR_CURVE!r} is not a ConfigRecord"
                    if curves is None
                    else pr_curve_problem(
                        curves, len(names) if names else None, None if most is None else most + 2
                    )
                )
        if problem:
            missing.append((node, f"rejected: {problem}"))
        else:
            good.append((str(known[node] if node in known else metrics.get("partition-id", node)), r))
    if recorder is not None:
        record_missing(recorder, DEFAULT_STAGE, server_round, missing)
    return good


def run(grid: Grid, cfg, recorder, classes: list[str], model=None) -> None:
    """Single-centre training from ``model`` (default: a random classifier ``cfg.model``; SSL-L-FT
    passes the 004 network with the server's pre-trained encoder)."""
    nodes = sorted(grid.get_node_ids())
    model = model if model is not None else create_model(cfg.model, len(classes), cfg.image_size)
    init = ArrayRecord(model.state_dict())
    ckpt = latest_checkpoint(recorder.run_dir, DEFAULT_STAGE) if cfg.resume else None
    start = 1
    if ckpt is not None:
        recorder.restore(ckpt["recorder"])
        start = ckpt["round"] + 1
        log(INFO, "local: resuming after round %d from %s", ckpt["round"], recorder.run_dir)
    progress.of(recorder).start(DEFAULT_STAGE, cfg.num_server_rounds, start - 1)
    if ckpt is None:
        val, _ = _ask(grid, nodes, "evaluate", 0, "val", init, recorder=recorder)
        recorder.log_round(0, "val", val)
    for r in range(start, cfg.num_server_rounds + 1):
        started = time.monotonic()
        train, _ = _ask(grid, nodes, "train", r, arrays=init if r == 1 else None, recorder=recorder)
        val, _ = _ask(grid, nodes, "evaluate", r, "val", recorder=recorder)
        loss = mean_over_clients(train).get("train_loss")
        mean = recorder.log_round(r, "val", val, train={"train_loss": loss} if loss is not None else None)
        fields = [
            ("val balanced accuracy", f"{mean.get('balanced_accuracy', float('nan')):.3f}"),
            ("val accuracy", f"{mean.get('accuracy', float('nan')):.3f}"),
        ]
        left = progress.of(recorder).finish_round(DEFAULT_STAGE, r)
        seconds = time.monotonic() - started
        log(INFO, "%s", progress.round_line("local", r, cfg.num_server_rounds, fields, seconds, left))
        save_round(
            grid,
            recorder,
            DEFAULT_STAGE,
            r,
            {"arrays": {}, "strategy": {}, "recorder": recorder.state()},
            keep=cfg.keep_checkpoints,
        )
    test, replies = _ask(grid, nodes, "evaluate", cfg.num_server_rounds, "test", recorder=recorder)
    save_pr_curves(recorder, replies, classes, cfg.method)
    recorder.set_final(test, best_round=None)
    if cfg.test_set == "global":  # each client's own best model on the global test set (docs/test-sets.md)
        global_test, _ = _ask(
            grid, nodes, "evaluate", cfg.num_server_rounds, "global-test", recorder=recorder
        )
        recorder.set_global_test(global_test, cfg.test_data_path or "held out of the data")
    log(
        INFO,
        "local: each client tested its own best-on-val model (rounds %s)",
        {pid: int(m.get("best-round", 0)) for pid, m in test.items()},
    )
