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

from . import progress
from .common import save_round
from .flbt_family import save_pr_curves
from .nodes import SentTo


def _ask(
    grid: Grid,
    node_ids: list[int],
    kind: str,
    server_round: int,
    split: str | None = None,
    arrays: ArrayRecord | None = None,
    timeout: float = 3600,
) -> tuple[dict, list[Message]]:
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
    per_client = {}
    for r in replies:
        metrics = dict(r.content["metrics"])
        per_client[str(metrics.pop("partition-id"))] = metrics
    return dict(sorted(per_client.items(), key=lambda kv: int(kv[0]))), replies


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
        val, _ = _ask(grid, nodes, "evaluate", 0, "val", init)
        recorder.log_round(0, "val", val)
    for r in range(start, cfg.num_server_rounds + 1):
        started = time.monotonic()
        train, _ = _ask(grid, nodes, "train", r, arrays=init if r == 1 else None)
        val, _ = _ask(grid, nodes, "evaluate", r, "val")
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
    test, replies = _ask(grid, nodes, "evaluate", cfg.num_server_rounds, "test")
    save_pr_curves(recorder, replies, classes, cfg.method)
    recorder.set_final(test, best_round=None)
    if cfg.test_set == "global":  # each client's own best model on the global test set (docs/test-sets.md)
        global_test, _ = _ask(grid, nodes, "evaluate", cfg.num_server_rounds, "global-test")
        recorder.set_global_test(global_test, cfg.test_data_path or "held out of the data")
    log(
        INFO,
        "local: each client tested its own best-on-val model (rounds %s)",
        {pid: int(m.get("best-round", 0)) for pid, m in test.items()},
    )
