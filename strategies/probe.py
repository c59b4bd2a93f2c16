"""Server side of the encoder probes (run-config ``probe-every``; :mod:`fedderm.probes`).

After every ``probe-every``-th pre-training round (and after the last one) the server sends the
current global pre-training model to every client (``query.probe``); each replies with the
kNN and linear-probe metrics of its encoder on its validation split.  They are recorded as two
splits of ``rounds.csv`` / ``summary.json`` ``rounds``, ``probe-knn`` and ``probe-linear`` (one row
per client and a ``mean`` row, the usual metric columns, ``num-examples`` = validation images),
and so also in the TensorBoard events (``probe-knn/balanced_accuracy/mean``, …).
"""

from __future__ import annotations

from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from .common import send_and_receive, short_reason, wait_for_nodes
from .nodes import SentTo

PROBES = ("knn", "linear")


def probe_due(cfg, server_round: int, num_rounds: int) -> bool:
    """Whether pre-training round ``server_round`` of ``num_rounds`` is probed."""
    k = int(cfg.probe_every)
    return k > 0 and server_round >= 1 and (server_round % k == 0 or server_round == num_rounds)


def probe_round(grid: Grid, cfg, recorder, server_round: int, arrays: ArrayRecord) -> dict[str, dict]:
    """Probe the encoder of ``arrays`` on every connected client; record and return the means
    (``{"knn": {...}, "linear": {...}}``)."""
    nodes = wait_for_nodes(grid, cfg.min_clients, cfg.round_timeout)
    msgs = [
        Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})}),
            dst_node_id=n,
            message_type="query.probe",
        )
        for n in nodes
    ]
    per_kind: dict[str, dict[str, dict]] = {kind: {} for kind in PROBES}
    sent = SentTo(msgs)  # a dead node's error reply comes from the SuperLink: map by message id
    for msg in send_and_receive(grid, msgs, cfg.round_timeout):
        if msg.has_error():
            log(
                WARNING,
                "probe round %d: node %d failed: %s",
                server_round,
                sent.node_of(msg),
                short_reason(msg.error.reason),
            )
            continue
        metrics = dict(msg.content["metrics"])
        pid = str(metrics["partition-id"])
        for kind in PROBES:
            per_kind[kind][pid] = {
                k.split(".", 1)[1]: v for k, v in metrics.items() if k.startswith(kind + ".")
            }
            per_kind[kind][pid]["num-examples"] = int(metrics["num-examples"])
    means = {}
    for kind in PROBES:
        if per_kind[kind]:
            means[kind] = recorder.log_round(server_round, f"probe-{kind}", per_kind[kind])
    if means:
        log(
            INFO,
            "probe round %d: val balanced accuracy · kNN %.3f · linear %.3f (mean of %d clients)",
            server_round,
            means["knn"].get("balanced_accuracy", float("nan")),
            means["linear"].get("balanced_accuracy", float("nan")),
            len(per_kind["knn"]),
        )
    return means
