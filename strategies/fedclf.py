"""FedCLF (000 §III, 001 §III–IV): FedAvg of the clients' MoCo models (weighted by |D_c|) plus
the server's feature relay, then the shared fine-tuning stage.

Relay (Eq. 2): every client uploads its local features Q_l (reply record ``features``); the
next round each client receives the features of all *other* clients as remote features Q_r
(instruction record ``remote-features``), de-identified: one array with no node id, partition
id or per-client grouping, its rows shuffled by the server with an RNG seeded by
(``seed``, round).  Before round 1 the server asks every client for its initial features
(``query.features``), so Q_r exists from the first round ("at the beginning of each round ...
the local features are uploaded").  The features never enter FedAvg: ``aggregate_train`` takes
them out of the replies before averaging.

With ``fedclf.feature-sharing=false`` nothing is uploaded or relayed: FedMoCo.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp.strategy import FedAvg

from clients.fedclf import FEATURES, REMOTE
from fedderm.moco import build_moco
from fedderm.relay_privacy import relay_epsilon

from .common import Tracked
from .finetune import pretrain_strategy, pretrain_then_finetune


def relay_features(uploads: Mapping[int, np.ndarray], destination: int, rng: np.random.Generator,
                   order: Callable[[int], Any] | None = None) -> np.ndarray:
    """Eq. 2: Q_r for ``destination`` = the features every *other* client uploaded, as one array
    whose rows are shuffled (no trace of who sent which row).  The uploads are joined in ``order``
    of their node ids (a sort key; default: the ids themselves) before the shuffle."""
    others = [uploads[n] for n in sorted(uploads, key=order) if n != destination]
    if not others:
        some = next(iter(uploads.values()), np.empty((0, 0), np.float32))
        return np.empty((0, *some.shape[1:]), some.dtype)
    features = np.concatenate(others)
    return features[rng.permutation(len(features))]


class FedCLFStrategy(Tracked, FedAvg):
    """FedAvg of the MoCo models + de-identified feature relay (when ``feature_sharing``)."""

    def __init__(self, *, feature_sharing: bool, timeout: float = 3600, **kwargs):
        super().__init__(**kwargs)
        self.feature_sharing = feature_sharing
        self.timeout = timeout
        self.uploads: dict[int, np.ndarray] = {}  # node id -> its latest Q_l (server side only)
        self.partition_of: dict[int, int] = {}  # node id -> partition id, for the log only
        self.releases: dict[str, int] = {}  # partition id -> releases of one image so far (private relay)

    # -- collecting -------------------------------------------------------------------
    def _take_features(self, replies: Iterable[Message]) -> dict[int, np.ndarray]:
        """Remove the ``features`` record from every reply (FedAvg wants exactly one
        ArrayRecord) and return them by sender."""
        uploads = {}
        for r in replies:
            if r.has_error() or not r.has_content():
                continue
            nid = r.metadata.src_node_id
            if "metrics" in r.content and "partition-id" in r.content["metrics"]:
                self.partition_of[nid] = int(r.content["metrics"]["partition-id"])
                if "relay-releases" in r.content["metrics"] and FEATURES in r.content:
                    pid = str(self.partition_of[nid])
                    self.releases[pid] = self.releases.get(pid, 0) + int(r.content["metrics"]["relay-releases"])
            if FEATURES in r.content:
                uploads[nid] = r.content[FEATURES]["features"].numpy()
                del r.content[FEATURES]
        return uploads

    def collect_initial_features(self, arrays: ArrayRecord, node_ids: list[int], grid) -> None:
        """``query.features`` to every client: their initial Q_l, encoded by the initial model."""
        msgs = [Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 0})}),
                        dst_node_id=nid, message_type="query.features") for nid in node_ids]
        replies = list(grid.send_and_receive(msgs, timeout=self.timeout))
        for r in replies:
            if r.has_error():
                log(WARNING, "fedclf: node %d sent no initial features: %s", r.metadata.src_node_id, r.error.reason)
        self.uploads = self._take_features(replies)
        self._log_uploads(0)
        self._account(0)

    def _name(self, nid: int) -> str:
        return f"client {self.partition_of[nid]}" if nid in self.partition_of else f"node {nid}"

    def _log_uploads(self, server_round: int) -> None:
        for nid in sorted(self.uploads, key=self._name):
            f = self.uploads[nid]
            log(INFO, "fedclf round %d: %s uploaded %d features (%d bytes, %s)", server_round, self._name(nid),
                len(f), f.nbytes, f.dtype)

    # -- relaying ---------------------------------------------------------------------
    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if not self.feature_sharing or not messages:
            return messages
        destinations = sorted((m.metadata.dst_node_id for m in messages), key=self.node_order)
        if not self.uploads:
            self.collect_initial_features(arrays, destinations, grid)
        rng = np.random.default_rng([self.cfg.seed, server_round])
        out, received = [], {}
        for msg in sorted(messages, key=lambda m: self.node_order(m.metadata.dst_node_id)):  # rng draws by partition
            nid = msg.metadata.dst_node_id
            remote = relay_features(self.uploads, nid, rng, self.node_order)
            content = RecordDict({"arrays": msg.content["arrays"], "config": msg.content["config"]})
            if len(remote):
                content[REMOTE] = ArrayRecord({"features": Array(np.ascontiguousarray(remote))})
            out.append(Message(content=content, dst_node_id=nid, message_type=msg.metadata.message_type,
                               group_id=msg.metadata.group_id or None))
            received[self._name(nid)] = int(remote.nbytes)
            log(INFO, "fedclf round %d: relayed %d remote features (%d bytes, %s) to %s", server_round,
                len(remote), remote.nbytes, remote.dtype, self._name(nid))
        entry = {"round": server_round, "received_bytes": dict(sorted(received.items())),
                 "uploaded_bytes": dict(sorted((self._name(n), int(f.nbytes)) for n, f in self.uploads.items()))}
        relay = self.recorder.extra.get("feature_relay", [])
        self.recorder.update_extra({"feature_relay": [*relay, entry]})
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        uploads = self._take_features(replies)
        if self.feature_sharing:
            if uploads:
                self.uploads = uploads
                self._log_uploads(server_round)
                self._account(server_round)
            else:
                log(WARNING, "fedclf round %d: no client uploaded features; relaying the previous ones",
                    server_round)
        return super().aggregate_train(server_round, replies)


    def _account(self, server_round: int) -> None:
        """Private relay (``fedclf.relay-clip`` > 0): (ε, δ) per client after this round's upload
        (:func:`fedderm.relay_privacy.relay_epsilon`), in summary.json ``relay_privacy`` and TensorBoard."""
        if not self.releases:
            return
        sigma, delta = float(self.cfg.option("fedclf.relay-noise-multiplier")), float(self.cfg.option("fedclf.relay-delta"))
        eps = {pid: relay_epsilon(sigma, n, delta) for pid, n in sorted(self.releases.items())}
        entry = {"round": server_round, "delta": delta, "noise_multiplier": sigma,
                 "clip": float(self.cfg.option("fedclf.relay-clip")), "releases": dict(sorted(self.releases.items())),
                 "epsilon": eps}
        self.recorder.update_extra({"relay_privacy": [*self.recorder.extra.get("relay_privacy", []), entry]})
        self.recorder.track("privacy", server_round, {f"epsilon/client-{pid}": e for pid, e in eps.items()})
        log(INFO, "fedclf round %d: private relay (sigma %g, delta %g): epsilon per client %s", server_round, sigma,
            delta, {pid: round(e, 3) for pid, e in eps.items()})

    def state_dict(self):
        """The relay bank (each client's latest features) goes into the checkpoint too."""
        return {**super().state_dict(), "uploads": dict(self.uploads), "partition_of": dict(self.partition_of),
                "releases": dict(self.releases)}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.uploads, self.partition_of = dict(state["uploads"]), dict(state["partition_of"])
        self.releases = dict(state.get("releases", {}))


def build_strategy(cfg, recorder, feature_sharing: bool | None = None) -> FedCLFStrategy:
    """``feature_sharing`` defaults to ``fedclf.feature-sharing`` (FedMoCo passes False)."""
    if feature_sharing is None:
        feature_sharing = cfg.option("fedclf.feature-sharing")
    if feature_sharing is False and not cfg.option("fedclf.local-negatives"):
        log(INFO, "fedclf: without feature sharing the negatives are the local queue (MoCo); "
                  "fedclf.local-negatives=false is ignored")
    return pretrain_strategy(FedCLFStrategy, cfg, recorder, feature_sharing=feature_sharing,
                             timeout=cfg.round_timeout)


def initial_moco(cfg) -> ArrayRecord:
    """The seeded initial MoCo model (momentum encoder = main encoder)."""
    torch.manual_seed(cfg.seed)
    return ArrayRecord(build_moco(cfg.model, cfg.image_size).state_dict())


def run(grid, cfg, recorder, classes, feature_sharing: bool | None = None) -> None:
    pretrain_then_finetune(grid, cfg, recorder, classes, build_strategy(cfg, recorder, feature_sharing),
                           initial_moco(cfg))
