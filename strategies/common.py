"""What every fedderm strategy shares: per-client bookkeeping, reply validation, dropped
clients, best-on-val tracking, the round loop with per-round checkpoints and resume, and the
round-0 / per-round / final-test evaluation plan.

A method's strategy is a Flower strategy with :class:`Tracked` mixed in front of it, e.g.
``class FedAvgStrategy(Tracked, FedAvg)``; its rounds are driven by :func:`run_rounds`.

The helpers it uses live by job: :mod:`strategies.fastpoll` (the Grid with 0.1 s polling and the
transport codec), :mod:`strategies.nodes` (waiting for clients), :mod:`strategies.screening`
(reply checks), :mod:`strategies.traffic` (bytes on the wire), :mod:`strategies.recording` (the
record step of a round: what the hooks noted, costs, evaluation, best-on-val).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Iterable
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

import wire
from fedderm.checkpoint import DEFAULT_STAGE, latest_checkpoint, resume_step, save_checkpoint
from fedderm.config import Config
from fedderm.console import CHATTER
from fedderm.metrics import SELECTION_METRIC, mean_over_clients
from fedderm.paths import safe_component
from fedderm.results import RunRecorder, client_sort_key
from fedderm.state_store import new_token, register_simulation, unregister_simulation

from . import progress
from .globaltest import global_test
from .nodes import NodeView, SentTo, send_and_receive, wait_for_nodes
from .recording import Recording, RoundNotes
from .robust import robust_aggregate
from .screening import (
    count_problem,
    evaluation_problem,
    l2_distance,
    metrics_problem,
    partition_problem,
    pr_curve_problem,
    reply_problem,
    short_reason,
)
from .traffic import array_bytes, record_bytes


class StateClock:
    """The server's side of the client-state store (:mod:`fedderm.state_store`): numbers the
    intervals between checkpoints (``step``) and stamps every message with the ``fedderm-state``
    record the clients key and roll back their state by (:mod:`clients.state`).

    The stamp names the run (its folder's name, as one safe folder name) and never a path: where
    a client keeps its state is the client's business.  In a simulation the clock registers the
    run folder on this machine under its secret token (:func:`fedderm.state_store.register_simulation`),
    so that the simulated clients, and only they, keep their state in the run folder;
    :meth:`close` removes the registration."""

    def __init__(self, run_dir, keep: int, simulation: bool, resume: int = 0):
        run_dir = Path(run_dir).expanduser().resolve()
        self.run = safe_component(run_dir.name)
        self.keep, self.resume, self.step = int(keep), int(resume), int(resume)
        self.token = new_token()  # new for every server process: clients roll back once per token
        self.registered = False
        if simulation:
            try:
                register_simulation(self.token, run_dir)
                self.registered = True
            except OSError as err:
                log(
                    WARNING,
                    "client state: cannot register the simulation's run folder (%s); the "
                    "simulated clients keep their state in their default folder",
                    err,
                )

    @classmethod
    def for_run(cls, run_dir, cfg, simulation: bool) -> StateClock:
        """The clock of a run; resumed (``resume``) at the step of the newest checkpoint."""
        return cls(run_dir, cfg.keep_checkpoints, simulation, resume_step(run_dir) if cfg.resume else 0)

    def stamp(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "run": self.run,
                "step": self.step + 1,
                "resume": self.resume,
                "token": self.token,
                "keep": self.keep,
            }
        )

    def close(self) -> None:
        """The run ended: remove the simulation's registration (nothing in a deployment)."""
        if self.registered:
            unregister_simulation(self.token)
            self.registered = False


def save_round(
    grid: Grid, recorder: RunRecorder, stage: str, server_round: int, payload: dict[str, Any], keep: int
) -> None:
    """The checkpoint of (``stage``, ``server_round``), with the client-state step it closes."""
    clock = getattr(grid, "state_clock", None)
    step = clock.step + 1 if clock is not None else 0
    save_checkpoint(recorder.run_dir, stage, server_round, {**payload, "state-step": step}, keep=keep)
    if clock is not None:
        clock.step = step


def rounds_to_target(
    rounds: list[dict], targets: list[float], split: str = "val", metric: str = SELECTION_METRIC
) -> dict[str, int | None]:
    """First round whose mean ``metric`` on ``split`` reaches each target (002 Table 2); None if never.

    ``rounds`` are :attr:`RunRecorder.rounds` entries; keys of the result are the targets as
    written (``"0.55"``).
    """
    curve = [(r["round"], r["metrics"].get(metric)) for r in rounds if r["split"] == split]
    out: dict[str, int | None] = {}
    for target in targets:
        hit = [rnd for rnd, value in curve if value is not None and value == value and value >= target]
        out[f"{target:g}"] = min(hit) if hit else None
    return out


def common_metrics(contents: list[RecordDict], arrays: bool = True) -> list[RecordDict]:
    """``contents`` (screened replies) with their arrays (unless not ``arrays``) and, as their one
    MetricRecord ``metrics``, the scalar metrics every one of them holds: what Flower's metric
    aggregation takes (it stops on keys that differ between replies).  Contents as they are when
    they all hold the same scalar metrics."""
    if not contents or any("metrics" not in c.metric_records for c in contents):
        return contents
    common = [
        k
        for k, v in contents[0]["metrics"].items()
        if not isinstance(v, list)
        and all(k in c["metrics"] and not isinstance(c["metrics"][k], list) for c in contents)
    ]
    if arrays and all(list(c["metrics"].keys()) == common for c in contents):
        return contents
    out = []
    for c in contents:
        content = RecordDict({name: record for name, record in c.array_records.items()} if arrays else {})
        content["metrics"] = MetricRecord({k: c["metrics"][k] for k in common})
        out.append(content)
    return out


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """MetricRecord-safe copy: NaN (e.g. AUC with one class present) is left out."""
    return {k: float(v) for k, v in metrics.items() if v == v}


def consistent_replies(contents: list[RecordDict], weighted_by_key: str) -> bool:
    """Whether Flower's FedAvg accepts these reply contents for aggregation (its
    ``validate_message_reply_consistency``): one ArrayRecord each, with the same keys; one
    MetricRecord each, with the same keys, holding a scalar ``weighted_by_key``."""
    if any(len(c.array_records) != 1 or len(c.metric_records) != 1 for c in contents):
        return False
    arrays, metrics = next(iter(contents[0].array_records)), next(iter(contents[0].metric_records))
    array_keys, metric_keys = set(contents[0][arrays].keys()), set(contents[0][metrics].keys())
    return weighted_by_key in metric_keys and all(
        arrays in c
        and set(c[arrays].keys()) == array_keys
        and metrics in c
        and set(c[metrics].keys()) == metric_keys
        and not isinstance(c[metrics][weighted_by_key], list)
        for c in contents
    )


#: the one empty array every key of a :func:`_without_numbers` reply holds
_EMPTY = Array(np.zeros(0, dtype=np.float32))


def _without_numbers(msg: Message) -> Message:
    """A reply with ``msg``'s records, keys and metrics but every array an empty one: on it,
    Flower's FedAvg checks (one ArrayRecord, the same keys in every reply, one MetricRecord with
    the weighting key), logs and aggregates the metrics at no cost for the arrays."""
    content = RecordDict()
    for name, record in msg.content.items():
        content[name] = (
            ArrayRecord({k: _EMPTY for k in record}) if name in msg.content.array_records else record
        )
    return Message(content, reply_to=msg)


def cast_like(arrays: ArrayRecord, template: ArrayRecord) -> ArrayRecord:
    """``arrays`` with every array in the dtype it has in ``template``.

    Flower's weighted average returns float64 for integer buffers such as BatchNorm's
    ``num_batches_tracked``; the global model keeps the dtypes of the model it started from."""
    out = {}
    for key, array in arrays.items():
        want = template[key].dtype if key in template else array.dtype
        if array.dtype == want:
            out[key] = array
        else:
            values = wire.values(array)
            dtype = np.dtype(want)
            cast = np.rint(values).astype(dtype) if dtype.kind in "iu" else values.astype(dtype)
            out[key] = wire.to_array(np.asarray(cast))
    return ArrayRecord(out)


class Tracked(Recording):
    """Mixin for a Flower strategy: screens replies, records per-client metrics and missing
    clients, keeps the best model on val, and saves/restores its state for checkpoints.

    Flower's hooks (``configure_*``, ``aggregate_*``) do not write results: what they find goes
    into :attr:`notes`, which :func:`run_rounds` records once at the end of every round.

    Clients put their ``partition-id`` in every reply's MetricRecord; it is taken out before
    Flower's weighted averaging and used to key per-client rows in the results.  Subclasses
    with server state of their own extend :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(
        self, *, cfg: Config, recorder: RunRecorder, action: str = "", num_rounds: int | None = None, **kwargs
    ):
        super().__init__(**kwargs)
        self.cfg, self.recorder = cfg, recorder
        self.action = action  # train messages go out as "train.<action>" (e.g. train.pretrain)
        self.stage = action or DEFAULT_STAGE
        self.num_rounds = cfg.num_server_rounds if num_rounds is None else num_rounds
        self.split = "val"
        self.train_per_client: dict[str, dict[str, float]] = {}
        self.best_round: int | None = None
        self.best_score = float("-inf")
        self.best_arrays: ArrayRecord | None = None
        self.last_mean: dict[str, float] = {}
        #: the last evaluation's per-client metrics, set by aggregate_evaluate for the round loop to record
        self.evaluated: dict[str, dict[str, float]] | None = None
        self.sent: ArrayRecord | None = None  # the global model of the current train round
        self.accepted: list[Message] = []  # this round's train replies that passed screening
        #: this evaluation's replies that passed screening, with the partition id each is filed under
        self.eval_accepted: list[tuple[str, Message]] = []
        self._ridden: dict[int, str] = {}  # train replies whose val-in-train metrics were rejected
        self._round_start = time.monotonic()
        #: bytes of model traffic of the current round (``down``: server -> clients, ``up``:
        #: clients -> server, ``messages``); strategies with extra records add to it.
        self.traffic: dict[str, int] | None = None
        #: the wall time of the last round recorded (train + val), in seconds
        self.round_seconds = float("nan")
        #: what this round's hooks found, recorded at its end (:meth:`record_notes`); GPU peaks
        #: only on CUDA (client_app.dispatch adds ``wire.GPU_PEAK``)
        self.notes = RoundNotes()

    # -- screening replies ---------------------------------------------------------------
    def node_order(self, node_id: int) -> tuple[float, int]:
        """Sort key of a client: its partition id (from the handshake), then its node id.  Node ids
        are drawn at random per run, partition ids are not."""
        return self.recorder.node_partitions.get(node_id, math.inf), node_id

    def in_order(self, replies: Iterable[Message]) -> list[Message]:
        """``replies`` by :meth:`node_order` of their senders, not by arrival: sums over clients
        (aggregation, control variates) add in the same order in every run, so the same seed gives
        the same numbers with any number of clients."""
        return sorted(replies, key=lambda m: self.node_order(self.reply_node(m)))

    def reply_node(self, msg: Message) -> int:
        """The node ``msg`` answers for: the one its message was sent to (looked up by
        ``reply_to_message_id`` in this round's train and evaluate waves), not its
        ``src_node_id``, which is the SuperLink's for Flower's error reply of a dead node."""
        for sent in (getattr(self, "_sent_to", None), getattr(self, "_eval_sent_to", None)):
            if isinstance(sent, SentTo) and (node := sent.get(msg)) is not None:
                return node
        return msg.metadata.src_node_id

    #: ``True`` (FedAvg, FedProx): with ``val-in-train`` the val evaluation of round r's global model
    #: rides in round r+1's train message (:func:`run_rounds`).  Only for methods whose evaluate
    #: handler is ``clients.common.evaluate_split`` of the model the message carries, which is what
    #: ``client_app.dispatch`` runs on a train message's model before training on it.
    val_rides_train = False

    #: the records a train reply may hold (a method adds its own: SCAFFOLD's ``control-delta``,
    #: FedCLF's ``features``, FedMAE's ``local-arrays``); a reply with others is rejected
    reply_records: frozenset[str] = frozenset({"arrays", "metrics"})

    #: the split whose size, as each client declared it at the handshake, bounds a train reply's
    #: ``num-examples`` (the weight of its update), by :attr:`action`: the labelled images in
    #: supervised training and fine-tuning, every training image in pre-training
    WEIGHT_SPLITS = {"": "labelled", "finetune": "labelled", "pretrain": "train"}

    def kept_keys(self) -> frozenset[str]:
        """Keys of the global model that stay on the clients (FedBN's BatchNorm layers, FedMAE's
        excluded parameters): a train reply holds every other key sent, and only those."""
        return frozenset()

    def declared(self, node: int, split: str) -> int | None:
        """Images of ``split`` node ``node`` declared at the handshake; None without one (a strategy
        driven outside the ServerApp)."""
        sizes = self.recorder.node_sizes.get(node)
        return None if sizes is None else int(sizes[split])

    def num_classes(self) -> int | None:
        """The run's number of classes (from the handshake), or None before it is known."""
        names = (self.recorder.classes or {}).get("names")
        return len(names) if names else None

    def partition_problem(self, node: int, metrics, known: dict[int, int] | None = None) -> str | None:
        """:func:`~strategies.screening.partition_problem` against ``known`` (default: the
        handshake's node -> partition map)."""
        return partition_problem(node, metrics, self.recorder.node_partitions if known is None else known)

    def validate_reply(self, msg: Message) -> str | None:
        """Why this train reply must be rejected, or None.  Its records are the method's
        (:attr:`reply_records`); its metrics finite numbers, its ``partition-id`` the handshake's;
        ``num-examples`` (its weight) an integer from 1 to what it declared at the handshake
        (:attr:`WEIGHT_SPLITS`); its weights those of :meth:`weights_problem`."""
        node = self.reply_node(msg)
        ridden = self._ridden.pop(id(msg), None)  # its val-in-train metrics failed (take_val)
        if ridden:
            return ridden
        extra = sorted(set(msg.content.keys()) - self.reply_records)
        if extra:
            return f"records the method does not send: {extra[:3]}"
        metrics = msg.content.metric_records.get("metrics")
        if metrics is None:
            return "no 'metrics' MetricRecord"
        problem = metrics_problem(metrics) or self.partition_problem(node, metrics)
        if problem:
            return problem
        key, split = self.weighted_by_key, self.WEIGHT_SPLITS.get(self.action, "train")
        if key not in metrics:
            return f"no {key!r} (the weight of its update)"
        declared = f"{split} images it declared at the handshake"
        return count_problem(key, metrics[key], self.declared(node, split), declared=declared) or (
            self.weights_problem(msg)
        )

    def weights_problem(self, msg: Message) -> str | None:
        """Why the weights of a train reply cannot be aggregated, or None: they must match the
        global model sent this round (less :meth:`kept_keys`) key by key in shape and dtype, be
        finite, and (``max-update-norm`` > 0) lie within that L2 distance of it."""
        if self.sent is None:
            return None
        reply, kept = msg.content.array_records.get("arrays"), self.kept_keys()
        template = ArrayRecord({k: a for k, a in self.sent.items() if k not in kept}) if kept else self.sent
        problem = reply_problem(reply, template)
        bound = self.cfg.max_update_norm
        if problem is None and bound > 0 and (norm := l2_distance(reply, self.sent)) > bound:
            problem = f"its update's L2 norm {norm:.4g} exceeds max-update-norm = {bound:g}"
        return problem

    def validate_evaluation(
        self, msg: Message, record: str = "metrics", split: str | None = None
    ) -> str | None:
        """Why an evaluation reply (or, ``record`` = ``val-metrics``, the val metrics riding in a train
        reply) must be rejected, or None: only a MetricRecord (and on test, ``pr-curve``), its
        ``partition-id`` the handshake's, its metrics those of an evaluation
        (:func:`~strategies.screening.evaluation_problem`) of at most the images of ``split``
        (default: this evaluation's) it declared, its PR curves well formed."""
        node, split = self.reply_node(msg), split or self.split
        if record == "metrics":
            extra = sorted(set(msg.content.keys()) - {"metrics", wire.PR_CURVE})
            if extra:
                return f"records an evaluation does not send: {extra[:3]}"
        metrics = msg.content.metric_records.get(record)
        if metrics is None:
            return f"no {record!r} MetricRecord"
        most = self.declared(node, split) if split in ("val", "test") else None
        problem = self.partition_problem(node, metrics) or evaluation_problem(
            metrics, most, self.num_classes()
        )
        if problem is None and record == "metrics" and wire.PR_CURVE in msg.content:
            curves = msg.content.config_records.get(wire.PR_CURVE)
            if curves is None:
                return f"{wire.PR_CURVE!r} is not a ConfigRecord"
            problem = pr_curve_problem(curves, self.num_classes(), None if most is None else most + 2)
        return problem

    def screen(
        self,
        server_round: int,
        sent_to: list[int],
        replies: list[Message],
        validate: bool | Callable[[Message], str | None] = True,
    ) -> list[Message]:
        """The replies fit for aggregation; failures, silences and rejections are logged and
        recorded in ``summary.json`` under ``missing_clients``.  ``validate``: True for
        :meth:`validate_reply`, a function for another check, False for none."""
        check = self.validate_reply if validate is True else validate or None
        good, missing = [], []
        answered = set()
        for msg in replies:
            node = sent_to.node_of(msg) if isinstance(sent_to, SentTo) else self.reply_node(msg)
            answered.add(node)
            problem = (
                f"failed: {short_reason(msg.error.reason)}"
                if msg.has_error()
                else (f"rejected: {p}" if check is not None and (p := check(msg)) else None)
            )
            if problem:
                missing.append((node, problem))
            else:
                good.append(msg)
        missing += [
            (node, f"no reply within round-timeout={self.cfg.round_timeout:g} s")
            for node in sent_to
            if node not in answered
        ]
        self.note_missing(server_round, missing)
        return good

    def reply_partition(self, msg: Message, metrics) -> str:
        """The partition id a reply is filed under: the one the handshake gave its node (the
        reply's own ``partition-id`` claim in ``metrics`` only without a handshake)."""
        claim = metrics.get("partition-id")
        node = self.reply_node(msg)
        known = self.recorder.node_partitions
        return str(known[node] if node in known else claim if claim is not None else node)

    def _per_client(
        self, replies: list[Message], server_round: int | None = None, record: str = "metrics"
    ) -> dict[str, dict[str, float]]:
        """partition id (:meth:`reply_partition`) -> the metrics of each reply's MetricRecord
        ``record`` (``partition-id`` and the GPU peak taken out; the peaks recorded for
        ``server_round``), in client order."""
        per_client, peaks = {}, {}
        for msg in replies:
            if msg.has_error():
                continue
            metrics = msg.content[record]
            pid = self.reply_partition(msg, metrics)
            metrics.pop("partition-id", None)
            if wire.GPU_PEAK in metrics:
                peaks[pid] = float(metrics.pop(wire.GPU_PEAK))
            per_client[pid] = dict(metrics)
        if peaks and server_round is not None:  # train replies: the round's peak
            self.note_gpu_peaks(server_round, peaks)
        return dict(sorted(per_client.items(), key=lambda kv: client_sort_key(kv[0])))

    def configure_train(self, server_round, arrays, config, grid):
        self._round_start = time.monotonic()
        self.sent = arrays
        self._ridden = {}
        config["num-rounds"] = self.num_rounds
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if self.action:
            for msg in messages:
                msg.metadata.message_type = f"{MessageType.TRAIN}.{self.action}"
        self._sent_to = SentTo(messages)  # knows each reply's node once the messages are pushed
        self.count_traffic(down=sum(self.wire_bytes(m.content) for m in messages), messages=len(messages))
        return messages

    #: ``True``: the model is the unweighted mean of the accepted replies (not weighted by ``num-examples``)
    uniform_mean: bool = False
    #: Keys of the model the subclass computes itself after ``aggregate_train`` (e.g. FedDyn's
    #: parameters): the FedAvg mean leaves them out rather than computing and discarding them.
    own_keys: frozenset = frozenset()

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        ok = [r for r in replies if not r.has_error()]
        self.count_traffic(up=sum(self.wire_bytes(r.content) for r in ok), messages=len(ok))
        replies = self.screen(server_round, getattr(self, "_sent_to", []), replies)
        self.accepted = replies  # subclasses aggregate extra records of these replies only
        self.train_per_client = self._per_client(replies, server_round)
        if len(replies) < self.cfg.min_clients:
            log(
                WARNING,
                "%s round %d: %d usable replies < min-clients=%d; the global model is kept",
                self.stage,
                server_round,
                len(replies),
                self.cfg.min_clients,
            )
            return None, None
        arrays, metrics = self._aggregate(server_round, replies)
        if arrays is not None and self.sent is not None:
            arrays = cast_like(arrays, self.sent)
        return arrays, metrics

    def wire_bytes(self, content: RecordDict | ArrayRecord) -> int:
        """Bytes a message's arrays (or one ArrayRecord) take on the wire in this run."""
        if isinstance(content, ArrayRecord):
            return record_bytes(content, self.cfg.transport_dtype)
        return array_bytes(content, self.cfg.transport_dtype)

    def _aggregate(self, server_round: int, replies: list[Message]):
        """The next strategy's ``aggregate_train``.  Instead of Flower's own FedAvg one: its checks
        and log line, its metric aggregation (over the metrics every reply holds), and
        :func:`wire.weighted_mean` of the replies (the same bits, without Flower's decoding copies:
        docs/benchmarks.md), or with a robust ``aggregation`` Flower's rule for it
        (:mod:`strategies.robust`).  Replies with errors or that fail the checks go through
        Flower's FedAvg itself, without their numbers (:func:`_without_numbers`), for its log
        lines and its error."""
        following = super().aggregate_train
        if getattr(following, "__func__", None) is not FedAvg.aggregate_train:
            return following(server_round, replies)
        ok = [msg for msg in replies if not msg.has_error()]
        contents = common_metrics([msg.content for msg in ok]) if len(ok) == len(replies) else []
        if contents and consistent_replies(contents, self.weighted_by_key):
            if self.cfg.aggregation == "mean":
                # as FedAvg logs it; a console that leaves Flower's chatter out leaves this out too
                log(
                    INFO,
                    "aggregate_train: Received %s results and %s failures",
                    len(contents),
                    0,
                    extra=CHATTER,
                )
                metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        else:
            checked, metrics = following(
                server_round, [msg if msg.has_error() else _without_numbers(msg) for msg in replies]
            )
            if checked is None:
                return None, None
            contents = [msg.content for msg in ok]
        weights = [float(next(iter(c.metric_records.values()))[self.weighted_by_key]) for c in contents]
        if self.uniform_mean:  # e.g. SCAFFOLD Alg. 1: x ← x + (1/|S|) Σ Δy_i
            weights = [1.0] * len(contents)
        # Flower's checks above leave exactly one ArrayRecord per reply
        records = [next(iter(c.array_records.values())) for c in contents]
        if self.own_keys:
            records = [ArrayRecord({k: a for k, a in r.items() if k not in self.own_keys}) for r in records]
        if self.cfg.aggregation != "mean":
            metric_records = [next(iter(c.metric_records.values())) for c in contents]
            return robust_aggregate(self.cfg, server_round, ok, records, metric_records)
        return wire.weighted_mean(records, weights), metrics

    def combine(
        self, server_round: int, replies: list[Message], records: list[ArrayRecord], weights: list[float]
    ) -> ArrayRecord:
        """``records`` (one per reply, weighing ``weights``) combined as this run's ``aggregation``
        combines the updates: for records aggregated beside them (FedMAE's kept parameters)."""
        if self.cfg.aggregation == "mean":
            return wire.weighted_mean(records, weights)
        metrics = [MetricRecord({self.weighted_by_key: w}) for w in weights]
        return robust_aggregate(self.cfg, server_round, replies, records, metrics)[0]

    def aggregation_failed(self, server_round: int, step: str, err: Exception) -> None:
        """``step`` (``aggregate_train`` or ``aggregate_evaluate``) raised: log it (with the
        traceback), note it (summary.json ``aggregation_errors``); the round loop keeps the global
        model for this round and goes on."""
        log(
            ERROR,
            "%s round %d: %s failed: %s; the global model of this round is kept and the run goes on "
            "(summary.json: aggregation_errors)\n%s",
            self.stage,
            server_round,
            step,
            f"{type(err).__name__}: {err}",
            "".join(traceback.format_exception(err)).rstrip(),
        )
        self.note(
            "aggregation_errors",
            {
                "stage": self.stage,
                "round": server_round,
                "step": step,
                "error": f"{type(err).__name__}: {err}",
            },
        )

    def configure_evaluate(self, server_round, arrays, config, grid):
        self.split = str(config.get("split", "val"))
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        self._eval_sent_to = SentTo(messages)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        if not replies and not getattr(self, "_eval_sent_to", None):
            return None  # nothing was sent (e.g. no evaluation during pre-training)
        replies = self.screen(server_round, self._eval_sent_to, replies, validate=self.validate_evaluation)
        self.eval_accepted = [(self.reply_partition(msg, msg.content["metrics"]), msg) for msg in replies]
        per_client = self._per_client(replies)
        if not per_client:
            log(WARNING, "round %d: no client returned %s metrics", server_round, self.split)
            return None
        contents = common_metrics([msg.content for msg in replies], arrays=False)
        if sum(float(c["metrics"].get("num-examples", 0)) for c in contents) > 0:  # Flower's checks and logs
            super().aggregate_evaluate(
                server_round, [Message(c, reply_to=m) for c, m in zip(contents, replies)]
            )
        self.evaluated = per_client  # written by the round loop (evaluate_round), not from this hook
        scalars = {
            pid: {k: v for k, v in m.items() if isinstance(v, (int, float))} for pid, m in per_client.items()
        }
        return MetricRecord(_finite(mean_over_clients(scalars)))

    # -- evaluation plan and bookkeeping --------------------------------------------------
    def evaluate_round(
        self, grid: Grid, server_round: int, arrays: ArrayRecord, split: str, timeout: float
    ) -> dict[str, float]:
        """Send ``arrays`` to every client for evaluation on ``split``; return the mean metrics."""
        msgs = self.configure_evaluate(server_round, arrays, ConfigRecord({"split": split}), grid)
        self.evaluated = None
        replies = self.in_order(send_and_receive(grid, msgs, timeout))
        try:
            self.aggregate_evaluate(server_round, replies)
        except Exception as err:  # noqa: BLE001 - no reply may end the run: recorded, the round goes on
            self.aggregation_failed(server_round, "aggregate_evaluate", err)
            self.evaluated = None
        if self.evaluated is not None:
            self.last_mean = self.record_evaluation(server_round, self.evaluated)
        return self.last_mean

    def take_val(self, replies: list[Message]) -> dict[str, dict[str, float]]:
        """The per-client val metrics that rode in train ``replies`` (``wire.VAL_METRICS``), taken
        out of them (Flower's FedAvg checks want one MetricRecord per train reply)."""
        ridden = [msg for msg in replies if not msg.has_error() and wire.VAL_METRICS in msg.content]
        good = []
        for msg in ridden:  # a reply whose val metrics are bad is rejected as a whole (validate_reply)
            problem = self.validate_evaluation(msg, record=wire.VAL_METRICS, split="val")
            if problem:
                self._ridden[id(msg)] = f"{wire.VAL_METRICS}: {problem}"
            else:
                good.append(msg)
        per_client = self._per_client(good, record=wire.VAL_METRICS)
        for msg in ridden:
            del msg.content[wire.VAL_METRICS]
        return per_client

    def finish_ridden(
        self,
        server_round: int,
        arrays: ArrayRecord,
        per_client: dict[str, dict[str, float]],
        seconds: float,
        traffic: dict[str, int] | None,
    ) -> None:
        """Round ``server_round``'s val evaluation came back in the next round's train replies:
        record it and close the round as :meth:`evaluate_round` + :meth:`after_round` would have
        (its own ``traffic``, ``seconds`` = its start to the next round's start)."""
        self.split = "val"
        if per_client:
            self.evaluated = per_client
            self.last_mean = self.record_evaluation(server_round, per_client)
        else:
            log(WARNING, "round %d: no client returned val metrics", server_round)
        self.close_round(server_round, arrays, seconds, traffic)

    def close_round(
        self, server_round: int, arrays: ArrayRecord, seconds: float, traffic: dict[str, int] | None
    ) -> None:
        """Record a round whose val came after the next round had started (``val-in-train``): its
        own ``traffic`` and ``seconds`` noted, the notes recorded, then :meth:`after_round`; the
        current round's traffic count is left as it was."""
        current, self.traffic = self.traffic, traffic
        self.note_costs(server_round, seconds)
        self.record_notes()
        self.after_round(server_round, arrays)
        self.traffic = current

    def state_dict(self) -> dict[str, Any]:
        """Server-side state a checkpoint must hold to continue exactly (extend in subclasses)."""
        return {
            "best_round": self.best_round,
            "best_score": self.best_score,
            "best_arrays": None if self.best_arrays is None else wire.to_state_dict(self.best_arrays),
            "last_mean": dict(self.last_mean),
            # the last round's train metrics: its val row (rounds.csv train_loss) when its val is pending
            "train_per_client": dict(self.train_per_client),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_round, self.best_score = state["best_round"], state["best_score"]
        self.best_arrays = None if state["best_arrays"] is None else wire.to_record(state["best_arrays"])
        self.last_mean = dict(state["last_mean"])
        self.train_per_client = dict(state.get("train_per_client", {}))


def run_rounds(
    strategy: Tracked,
    grid: Grid,
    arrays: ArrayRecord,
    *,
    evaluate: bool = True,
    on_round: Callable[[int, ArrayRecord], None] | None = None,
) -> ArrayRecord:
    """Drive ``strategy.num_rounds`` rounds (train, then val if ``evaluate``) and return the
    final global model.

    Every round waits (at most ``round-timeout``) for ``min-clients`` connected clients, goes on
    with the replies that arrive in time, and ends with a checkpoint.  With ``resume`` set, the
    loop restarts after the newest checkpoint of this stage instead of round 1.

    With ``val-in-train`` and a strategy whose :attr:`Tracked.val_rides_train` is set, round r's
    val evaluation (round 0's too) rides in round r+1's train message: each client evaluates the
    model it receives, which is round r's global model, before training on it, so a round is one
    exchange instead of two with the same metrics; only the last round's val is a message of its
    own.  Round r's checkpoint then holds its val as pending (``val-pending``): a resumed run
    evaluates it in its first train message.
    """
    try:
        return _run_rounds(strategy, grid, arrays, evaluate, on_round)
    finally:  # what a failing round's hooks found (e.g. the clients left out) still reaches the results
        strategy.record_notes()


def _run_rounds(
    strategy: Tracked,
    grid: Grid,
    arrays: ArrayRecord,
    evaluate: bool,
    on_round: Callable[[int, ArrayRecord], None] | None,
) -> ArrayRecord:
    """:func:`run_rounds`: each round sends, screens and aggregates (Flower's hooks, which only
    note what they find), evaluates, records (notes, costs, best-on-val) and checkpoints."""
    cfg, recorder = strategy.cfg, strategy.recorder
    ride = evaluate and on_round is None and strategy.val_rides_train and cfg.val_in_train
    #: (round, its global model, its start, its traffic) of the round whose val rides in the next train
    pending: tuple[int, ArrayRecord, float, dict | None] | None = None
    start = 1
    ckpt = latest_checkpoint(recorder.run_dir, strategy.stage) if cfg.resume else None
    if ckpt is not None:
        arrays = wire.to_record(ckpt["arrays"])
        strategy.load_state_dict(ckpt["strategy"])
        recorder.restore(ckpt["recorder"])
        start = ckpt["round"] + 1
        log(INFO, "resuming %s after round %d from %s", strategy.stage, ckpt["round"], recorder.run_dir)
        if ckpt.get("val-pending") and evaluate:
            pending = (ckpt["round"], arrays, time.monotonic(), ckpt.get("pending-traffic"))
    progress.of(recorder).start(strategy.stage, strategy.num_rounds, start - 1)
    if ckpt is None and evaluate:
        strategy._round_start = time.monotonic()
        if ride:
            pending = (0, arrays, strategy._round_start, None)
        else:
            strategy.evaluate_round(grid, 0, arrays, "val", cfg.round_timeout)
            strategy.note_costs(0)
            strategy.record_notes()
            (on_round or strategy.after_round)(0, arrays)
    view = None
    for server_round in range(start, strategy.num_rounds + 1):
        # send
        view = NodeView(grid, wait_for_nodes(grid, cfg.min_clients, cfg.round_timeout))
        config = ConfigRecord({wire.VAL_ROUND: pending[0]} if pending is not None else {})
        msgs = strategy.configure_train(server_round, arrays, config, view)
        replies = strategy.in_order(send_and_receive(grid, msgs, cfg.round_timeout))
        if pending is not None:  # the previous round's val came back with these replies: close it
            done, done_arrays, started, traffic = pending
            val = strategy.take_val(replies)
            strategy.finish_ridden(done, done_arrays, val, strategy._round_start - started, traffic)
            pending = None
        # screen and aggregate
        try:
            new, _ = strategy.aggregate_train(server_round, replies)
        except Exception as err:  # noqa: BLE001 - no reply may end the run: recorded, the model is kept
            strategy.aggregation_failed(server_round, "aggregate_train", err)
            new = None
        if new is not None:
            arrays = new
        # evaluate (or let the val ride in the next round's train message), then record
        if ride:
            strategy.record_notes()
            pending = (server_round, arrays, strategy._round_start, strategy.traffic)
            strategy.traffic = None
        else:
            if evaluate:
                strategy.evaluate_round(view, server_round, arrays, "val", cfg.round_timeout)
            strategy.note_costs(server_round)
            strategy.record_notes()
            (on_round or strategy.after_round)(server_round, arrays)
        # checkpoint
        save_round(
            grid,
            recorder,
            strategy.stage,
            server_round,
            {
                "arrays": wire.to_state_dict(arrays),
                "strategy": strategy.state_dict(),
                "recorder": recorder.state(),
                "val-pending": ride,
                "pending-traffic": pending[3] if pending is not None else None,  # its bytes_per_round entry
            },
            keep=cfg.keep_checkpoints,
        )
    if pending is not None:  # the last round's val: no train message follows, an evaluate message of its own
        done, done_arrays, started, traffic = pending
        if view is None:
            view = NodeView(grid, wait_for_nodes(grid, cfg.min_clients, cfg.round_timeout))
        strategy.evaluate_round(view, done, done_arrays, "val", cfg.round_timeout)
        strategy.close_round(done, done_arrays, time.monotonic() - started, traffic)
    return arrays


def run_federated(strategy: Tracked, grid: Grid, initial_arrays: ArrayRecord) -> ArrayRecord:
    """Round 0 on val, ``strategy.num_rounds`` rounds of train + val, then test with the
    best-on-val model; saves ``model.pt`` (final) and ``model-best.pt``.  Returns the final
    global model."""
    final = run_rounds(strategy, grid, initial_arrays)
    best = strategy.best_arrays or final
    log(INFO, "testing the best model on val (round %s) on every client's test split", strategy.best_round)
    view = NodeView(grid, wait_for_nodes(grid, strategy.cfg.min_clients, strategy.cfg.round_timeout))
    try:
        strategy.evaluate_round(view, strategy.num_rounds, best, "test", strategy.cfg.round_timeout)
        global_test(strategy, view, best, strategy.num_rounds)  # test-set="global" only
    finally:
        strategy.record_notes()
    reached = rounds_to_target(strategy.recorder.rounds, strategy.cfg.target_list)
    strategy.recorder.update_extra({"rounds_to_target": reached})
    if reached:
        log(
            INFO,
            "mean val %s reached: %s",
            progress.metric_label(SELECTION_METRIC),
            progress.reached(reached),
        )
    strategy.recorder.save_model(wire.to_state_dict(final))
    strategy.recorder.save_model(wire.to_state_dict(best), name="model-best.pt")
    return final
