"""FedCLF (000 §III, 001 §III–IV): FedAvg of the clients' MoCo models (weighted by |D_c|) plus
the server's feature relay, then the shared fine-tuning stage.

Relay (Eq. 2): every client uploads its local features Q_l (reply record ``features``); the
next round each client receives the features of all *other* clients as remote features Q_r
(instruction record ``remote-features``), de-identified: one array with no node id, partition
id or per-client grouping, its rows shuffled by the server with a generator seeded by the OS's
CSPRNG every round (:func:`fedderm.noise.secure_generator`; ``insecure-reproducible-noise``: by
(``seed``, round)), so that no client can undo the shuffle; clients sort what they receive
(:func:`fedderm.relay_privacy.canonical_order`), so the shuffle changes no number.  Before
round 1 the server asks every client for its initial features (``query.features``), so Q_r
exists from the first round ("at the beginning of each round ... the local features are
uploaded").  The features never enter FedAvg: ``aggregate_train`` takes them out of the replies
before averaging.

With ``fedclf.feature-sharing=false`` nothing is uploaded or relayed: FedMoCo.  With ``"auto"``
(the default) a deployment relays only through the private relay (noise multiplier > 0), else
the run stops before any feature is asked for (:func:`fedderm.methods.fedclf.feature_sharing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp.strategy import FedAvg

import wire
from fedderm.methods.fedclf import feature_sharing as resolve_sharing
from fedderm.moco import FEATURE_DIM, build_moco
from fedderm.noise import REPRODUCIBLE, secure_generator
from fedderm.relay_privacy import relay_epsilon
from wire import FEATURES, REMOTE, to_array, to_record

from .common import Tracked
from .dp import deployed, refuse_reproducible_noise
from .finetune import pretrain_strategy, pretrain_then_finetune
from .nodes import SentTo
from .screening import count_problem, metrics_problem, unit_problem


def relay_features(
    uploads: Mapping[int, np.ndarray],
    destination: int,
    rng: np.random.Generator,
    order: Callable[[int], Any] | None = None,
) -> np.ndarray:
    """Eq. 2: Q_r for ``destination`` = the features every *other* client uploaded, as one array
    whose rows are shuffled (no trace of who sent which row).  The uploads are joined in ``order``
    of their node ids (a sort key; default: the ids themselves) before the shuffle."""
    others = [uploads[n] for n in sorted(uploads, key=order) if n != destination]
    if not others:
        some = next(iter(uploads.values()), np.empty((0, 0), np.float32))
        return np.empty((0, *some.shape[1:]), some.dtype)
    features = np.concatenate(others)
    return features[rng.permutation(len(features))]


def feature_problem(record: ArrayRecord | None, queue_size: int, dtype: str) -> str | None:
    """Why a client's feature upload (``features`` record) must not enter the relay bank, or
    None: it must be one ``features`` array of 1 to K rows of ``FEATURE_DIM`` finite values in
    ``fedclf.feature-dtype``."""
    if record is None:
        return f"no {FEATURES!r} record (feature sharing is on)"
    if list(record.keys()) != ["features"]:
        return f"the {FEATURES!r} record holds {sorted(record.keys())[:3]}, expected ['features']"
    values = wire.values(record["features"])
    if values.ndim != 2 or values.shape[1] != FEATURE_DIM or not 1 <= values.shape[0] <= queue_size:
        return (
            f"features of shape {list(values.shape)}, expected [1..{queue_size}, {FEATURE_DIM}] "
            "(fedclf.queue-size, the MoCo feature dimension)"
        )
    if values.dtype != np.dtype(dtype):
        return f"features in {values.dtype}, expected {dtype} (fedclf.feature-dtype)"
    if not np.isfinite(values).all():
        return "features hold non-finite values (NaN or inf)"
    return None


class FedCLFStrategy(Tracked, FedAvg):
    """FedAvg of the MoCo models + de-identified feature relay (when ``feature_sharing``).

    The relay bank holds, per partition id (stable across a resume, unlike node ids), the
    latest features that passed screening (:func:`feature_problem`); a reply with a bad upload
    is rejected like a bad model update, and its features are never relayed."""

    def __init__(self, *, feature_sharing: bool, timeout: float = 3600, **kwargs):
        super().__init__(**kwargs)
        self.feature_sharing = feature_sharing
        self.timeout = timeout
        self.uploads: dict[int, np.ndarray] = {}  # partition id -> its latest Q_l (server side only)
        self.partition_of: dict[int, int] = {}  # node id -> partition id, from the replies (this run)
        self.releases: dict[str, int] = {}  # partition id -> releases of one image so far (private relay)

    # -- collecting -------------------------------------------------------------------
    def _note_partition(self, msg: Message) -> None:
        metrics = msg.content.metric_records.get("metrics") if msg.has_content() else None
        if metrics is not None and not count_problem("partition-id", metrics.get("partition-id"), least=0):
            self.partition_of[self.reply_node(msg)] = int(metrics["partition-id"])

    def _pid(self, nid: int) -> int:
        """The partition id of node ``nid`` (handshake, else its replies; else the node id)."""
        return int(self.recorder.node_partitions.get(nid, self.partition_of.get(nid, nid)))

    def _take_features(self, replies: Iterable[Message]) -> dict[int, np.ndarray]:
        """Remove the ``features`` record from every reply (FedAvg wants exactly one
        ArrayRecord) and return them by the sender's partition id."""
        uploads = {}
        for r in replies:
            if r.has_error() or not r.has_content():
                continue
            if FEATURES in r.content:
                pid = self._pid(self.reply_node(r))
                uploads[pid] = r.content[FEATURES]["features"].numpy()
                if "metrics" in r.content and "relay-releases" in r.content["metrics"]:  # private relay
                    self.releases[str(pid)] = self.releases.get(str(pid), 0) + int(
                        r.content["metrics"]["relay-releases"]
                    )
                del r.content[FEATURES]
        return uploads

    def feature_problem(self, msg: Message) -> str | None:
        return feature_problem(
            msg.content.array_records.get(FEATURES),
            int(self.cfg.option("fedclf.queue-size")),
            str(self.cfg.option("fedclf.feature-dtype")),
        )

    reply_records = Tracked.reply_records | {FEATURES}

    def relay_metrics_problem(self, msg: Message) -> str | None:
        """Why the relay's own metrics of a reply cannot be read, or None: finite numbers, counts
        (``relay-releases``, ``remote-features``, the audit's members and non-members) non-negative
        integers, the audit's ``leakage-auc`` in [0, 1] and with its two counts."""
        metrics = msg.content.metric_records.get("metrics")
        if metrics is None:
            return "no 'metrics' MetricRecord"
        problem = metrics_problem(metrics) or unit_problem(metrics, ["leakage-auc"])
        for key in ("relay-releases", "remote-features", "leakage-members", "leakage-non-members"):
            if problem is None and key in metrics:
                problem = count_problem(key, metrics[key], least=0)
        if problem is None and "leakage-auc" in metrics:
            if not {"leakage-members", "leakage-non-members"} <= set(metrics.keys()):
                problem = "'leakage-auc' without 'leakage-members' and 'leakage-non-members'"
        return problem

    def validate_reply(self, msg: Message) -> str | None:
        """The model checks of every method, the relay's metrics, then (feature sharing) the
        feature upload's."""
        self._note_partition(msg)
        problem = super().validate_reply(msg) or self.relay_metrics_problem(msg)
        if problem is None and self.feature_sharing:
            problem = self.feature_problem(msg)
        return problem

    def collect_initial_features(self, arrays: ArrayRecord, node_ids: list[int], grid) -> None:
        """``query.features`` to every client: their initial Q_l, encoded by the initial model;
        uploads that fail :func:`feature_problem` are rejected and logged."""
        msgs = [
            Message(
                RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 0})}),
                dst_node_id=nid,
                message_type="query.features",
            )
            for nid in node_ids
        ]
        self._sent_to = SentTo(msgs)  # who each reply answers for, once pushed
        replies = list(grid.send_and_receive(msgs, timeout=self.timeout))
        good, rejected = [], []
        for r in self.in_order(replies):
            nid = self.reply_node(r)
            self._note_partition(r)
            if r.has_error():
                log(WARNING, "fedclf: node %d sent no initial features: %s", nid, r.error.reason)
            elif problem := (
                self.partition_problem(nid, r.content.metric_records.get("metrics") or {})
                or self.relay_metrics_problem(r)
                or self.feature_problem(r)
            ):
                rejected.append((nid, f"rejected: {problem}"))
            else:
                good.append(r)
        self.note_missing(0, rejected)
        self.uploads = self._take_features(good)
        self._log_uploads(0)
        self._account(0)

    def _log_uploads(self, server_round: int) -> None:
        for pid in sorted(self.uploads):
            f = self.uploads[pid]
            log(
                INFO,
                "fedclf round %d: client %d uploaded %d features (%d bytes, %s)",
                server_round,
                pid,
                len(f),
                f.nbytes,
                f.dtype,
            )

    # -- relaying ---------------------------------------------------------------------
    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if not self.feature_sharing or not messages:
            return messages
        destinations = sorted((m.metadata.dst_node_id for m in messages), key=self.node_order)
        if not self.uploads:
            self.collect_initial_features(arrays, destinations, grid)
        rng = shuffle_generator(self.cfg, server_round)
        out, received = [], {}
        for msg in sorted(
            messages, key=lambda m: self.node_order(m.metadata.dst_node_id)
        ):  # rng draws by partition
            nid = msg.metadata.dst_node_id
            pid = self._pid(nid)
            remote = relay_features(self.uploads, pid, rng)
            content = RecordDict({"arrays": msg.content["arrays"], "config": msg.content["config"]})
            if len(remote):
                content[REMOTE] = ArrayRecord({"features": to_array(np.ascontiguousarray(remote))})
            out.append(
                Message(
                    content=content,
                    dst_node_id=nid,
                    message_type=msg.metadata.message_type,
                    group_id=msg.metadata.group_id or None,
                )
            )
            received[f"client {pid}"] = int(remote.nbytes)
            log(
                INFO,
                "fedclf round %d: relayed %d remote features (%d bytes, %s) to client %d",
                server_round,
                len(remote),
                remote.nbytes,
                remote.dtype,
                pid,
            )
        entry = {
            "round": server_round,
            "received_bytes": dict(sorted(received.items())),
            "uploaded_bytes": dict(sorted((f"client {p}", int(f.nbytes)) for p, f in self.uploads.items())),
        }
        self.note("feature_relay", entry)
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        arrays, metrics = super().aggregate_train(server_round, replies)
        if self.feature_sharing and arrays is None:
            log(
                WARNING,
                "fedclf round %d: too few usable replies; relaying the previous features",
                server_round,
            )
        return arrays, metrics

    def _record_leakage(self, server_round: int, replies: list[Message]) -> None:
        """``fedclf.leakage-audit``: the clients' attack AUCs (``leakage-auc``, taken out of the
        metrics FedAvg averages) as split ``leakage-audit`` of rounds.csv / summary.json (column
        ``auc``, ``num-examples`` = members + non-members; summary.json also has ``members`` and
        ``non-members``) and TensorBoard."""
        per_client = {}
        for r in replies:
            metrics = r.content["metrics"]
            if "leakage-auc" not in metrics:
                continue
            auc = float(metrics.pop("leakage-auc"))
            members, others = int(metrics.pop("leakage-members")), int(metrics.pop("leakage-non-members"))
            per_client[str(self._pid(self.reply_node(r)))] = {
                "auc": auc,
                "num-examples": members + others,
                "members": members,
                "non-members": others,
            }
        if per_client:
            mean = self.note_split(server_round, "leakage-audit", per_client)
            log(
                INFO,
                "fedclf round %d: leakage audit (membership attack on the relay): ROC-AUC mean %.3f, %s",
                server_round,
                mean["auc"],
                {pid: round(m["auc"], 3) for pid, m in per_client.items()},
            )

    def _aggregate(self, server_round: int, replies: list[Message]):
        """The screened replies only: their features become the relay bank, then FedAvg."""
        self._record_leakage(server_round, replies)
        uploads = self._take_features(replies)
        if self.feature_sharing:
            if uploads:
                self.uploads = uploads
                self._log_uploads(server_round)
                self._account(server_round)
            else:
                log(
                    WARNING,
                    "fedclf round %d: no client uploaded features; relaying the previous ones",
                    server_round,
                )
        return super()._aggregate(server_round, replies)

    def _account(self, server_round: int) -> None:
        """Private relay (``fedclf.relay-clip`` > 0): (ε, δ) per client after this round's upload
        (:func:`fedderm.relay_privacy.relay_epsilon`), in summary.json ``relay_privacy`` and TensorBoard."""
        if not self.releases:
            return
        sigma, delta = (
            float(self.cfg.option("fedclf.relay-noise-multiplier")),
            float(self.cfg.option("fedclf.relay-delta")),
        )
        eps = {pid: relay_epsilon(sigma, n, delta) for pid, n in sorted(self.releases.items())}
        entry = {
            "round": server_round,
            "delta": delta,
            "noise_multiplier": sigma,
            "clip": float(self.cfg.option("fedclf.relay-clip")),
            "releases": dict(sorted(self.releases.items())),
            "epsilon": eps,
        }
        self.note("relay_privacy", entry)
        self.note_scalars("privacy", server_round, {f"epsilon/client-{pid}": e for pid, e in eps.items()})
        log(
            INFO,
            "fedclf round %d: private relay (sigma %g, delta %g): epsilon per client %s",
            server_round,
            sigma,
            delta,
            {pid: round(e, 3) for pid, e in eps.items()},
        )

    def state_dict(self):
        """The relay bank (each client's latest features) goes into the checkpoint too."""
        return {
            **super().state_dict(),
            "uploads": dict(self.uploads),  # by partition id
            "releases": dict(self.releases),
        }

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.uploads = {int(pid): f for pid, f in state["uploads"].items()}
        self.releases = dict(state.get("releases", {}))


def shuffle_generator(cfg, server_round: int) -> np.random.Generator:
    """The generator of round ``server_round``'s relay shuffle: seeded by the OS's CSPRNG, or under
    ``insecure-reproducible-noise`` by (``seed``, round), which every client knows."""
    if cfg.insecure_reproducible_noise:
        log(
            WARNING,
            "fedclf round %d: %s = true: the relay's shuffle is seeded from seed and round; a client "
            "can attribute every relayed row to its source",
            server_round,
            REPRODUCIBLE,
        )
        return np.random.default_rng([cfg.seed, server_round])
    return secure_generator()


def build_strategy(
    cfg, recorder, feature_sharing: bool | None = None, deployment: bool = False
) -> FedCLFStrategy:
    """``feature_sharing`` defaults to ``fedclf.feature-sharing`` (FedMoCo passes False), whose
    ``"auto"`` depends on ``deployment`` (:func:`fedderm.methods.fedclf.feature_sharing`)."""
    if feature_sharing is None:
        feature_sharing = resolve_sharing(cfg, deployment)
    if feature_sharing is False and not cfg.option("fedclf.local-negatives"):
        log(
            INFO,
            "fedclf: without feature sharing the negatives are the local queue (MoCo); "
            "fedclf.local-negatives=false is ignored",
        )
    return pretrain_strategy(
        FedCLFStrategy, cfg, recorder, feature_sharing=feature_sharing, timeout=cfg.round_timeout
    )


def initial_moco(cfg) -> ArrayRecord:
    """The seeded initial MoCo model (momentum encoder = main encoder)."""
    torch.manual_seed(cfg.seed)
    return to_record(build_moco(cfg.model, cfg.image_size).state_dict())


def run(grid, cfg, recorder, classes, feature_sharing: bool | None = None) -> None:
    """Pre-train, then fine-tune.  A deployment stops here, before any message, when the run would
    relay raw features without saying so (``fedclf.feature-sharing = "auto"``) or would relay with
    ``insecure-reproducible-noise``."""
    strategy = build_strategy(cfg, recorder, feature_sharing, deployment=deployed(grid))
    if strategy.feature_sharing:
        refuse_reproducible_noise(cfg, grid, "the relay's noise and shuffle")
    pretrain_then_finetune(grid, cfg, recorder, classes, strategy, initial_moco(cfg))
