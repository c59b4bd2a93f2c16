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
from .recording import record_missing
from .screening import count_problem, evaluation_problem, partition_problem

PROBES = ("knn", "linear")


def probe_due(cfg, server_round: int, num_rounds: int) -> bool:
    """Whether pre-training round ``server_round`` of ``num_rounds`` is probed."""
    k = int(cfg.probe_every)
    return k > 0 and server_round >= 1 and (server_round % k == 0 or server_round == num_rounds)


def probe_problem(msg: Message, node: int, recorder) -> str | None:
    """Why a probe reply cannot be recorded, or None: only a MetricRecord, its node's partition id,
    each probe's metrics an evaluation's (:func:`~strategies.screening.evaluation_problem`) of at
    most the validation images it declared, ``labelled`` at most its labelled images."""
    extra = sorted(set(msg.content.keys()) - {"metrics"})
    metrics = msg.content.metric_records.get("metrics")
    if extra or metrics is None:
        return f"a probe reply holds one MetricRecord 'metrics', not {sorted(msg.content.keys())[:3]}"
    sizes = recorder.node_sizes.get(node, {})
    names = (recorder.classes or {}).get("names")
    problem = partition_problem(node, metrics, recorder.node_partitions)
    for kind in PROBES:
        problem = problem or evaluation_problem(
            metrics, sizes.get("val"), len(names) if names else None, f"{kind}."
        )
    if problem is None and "num-examples" not in metrics:
        problem = "no 'num-examples'"
    if problem is None and "labelled" in metrics:
        problem = count_problem(
            "labelled",
            metrics["labelled"],
            sizes.get("labelled"),
            least=0,
            declared="labelled images it declared",
        )
    return problem


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
    rejected = []
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
        node = sent.node_of(msg)
        if problem := probe_problem(msg, node, recorder):
            rejected.append((node, f"rejected: {problem}"))
            continue
        metrics = dict(msg.content["metrics"])
        claim = metrics.get("partition-id", node)
        pid = str(recorder.node_partitions.get(node, claim))  # the handshake's partition, not the claim
        for kind in PROBES:
            per_kind[kind][pid] = {
                k.split(".", 1)[1]: v for k, v in metrics.items() if k.startswith(kind + ".")
            }
            per_kind[kind][pid]["num-examples"] = int(metrics["num-examples"])
    record_missing(recorder, "probe", server_round, rejected)
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
