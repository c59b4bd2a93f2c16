"""SiFT (paper 002 §2): serial ring training, no averaging.

Each round the ServerApp hands the model pair (short-term, long-term) to one client at a time,
in ``partition-id`` order, waits for its reply and passes the result on to the next client
(Fig. 1b); a round is every client visited once.  A client that fails or does not answer within
``sift.hop-timeout`` seconds is skipped with a log line and the ring goes on.  The long-term model
(the short-term one for ``sift.variant="single"``) is what is evaluated and tested.

The class texts are embedded once per run here, on the server, where the class names are known;
clients receive W inside the model's state dict.
"""

from __future__ import annotations

import math
import time
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

import wire
from fedderm.methods import need
from fedderm.sift import (
    LONG_BN_MODES,
    VARIANTS,
    build_sift_model,
    class_text_embeddings,
    class_texts,
    random_matrix,
)

from .common import Tracked, run_federated
from .nodes import SentTo
from .screening import count_problem, info_problem, l2_distance, metrics_problem, reply_problem

#: Record keys of the model pair in ring messages and replies.
SHORT, LONG = "short", "long"


def projector_seed(cfg) -> int:
    return cfg.seed * 7919 + 17


def head_embeddings(cfg, classes: list[str]) -> torch.Tensor:
    """W (C × d) for the run: text embeddings of the class texts, or for ``random-head`` a seeded
    random matrix of the same shape.  Called once per run."""
    if cfg.option("sift.variant") == "trainable-head":
        return torch.zeros(len(classes), 1)  # a linear head replaces P and W: no text needed
    texts = class_texts(cfg.option("sift.class-texts"), classes)
    model = cfg.option("sift.text-model")
    log(
        INFO,
        "SiFT: embedding %d class texts with %s (%s pooling): %s",
        len(texts),
        model,
        cfg.option("sift.text-pooling"),
        "; ".join(texts),
    )
    embeddings = class_text_embeddings(model, texts, cfg.option("sift.text-pooling"), cfg.cache_path)
    if cfg.option("sift.variant") == "random-head":
        return random_matrix(*embeddings.shape, seed=cfg.seed * 7919 + 29)
    return embeddings


class SiftStrategy(Tracked, FedAvg):
    """The ring: :meth:`configure_train` replaces Flower's parallel round by sequential hops.

    Evaluation (val each round, test at the end) uses FedAvg's broadcast to every client.
    """

    def __init__(self, *, cfg, recorder, **kwargs):
        super().__init__(cfg=cfg, recorder=recorder, **kwargs)
        self.variant = cfg.option("sift.variant")
        self.hop_timeout = float(cfg.option("sift.hop-timeout"))
        self.partition_of: dict[int, int] = dict(recorder.node_partitions)  # node id -> partition id
        self.pair: dict[str, ArrayRecord] | None = None  # (short-term, long-term) models on their way

    # -- who is in the ring, in which order ---------------------------------------------
    def ring_order(self, grid: Grid) -> list[int]:
        """Connected node ids sorted by the clients' ``partition-id`` (asked once per node with
        ``query.info``); a node that cannot answer is left out of this round, with a log line."""
        nodes = sorted(grid.get_node_ids())
        unknown = [n for n in nodes if n not in self.partition_of]
        if unknown:
            msgs = [
                Message(RecordDict({"config": ConfigRecord()}), dst_node_id=n, message_type="query.info")
                for n in unknown
            ]
            sent = SentTo(msgs)  # a dead node's error reply comes from the SuperLink
            for reply in grid.send_and_receive(msgs, timeout=self.hop_timeout):
                nid = sent.node_of(reply)
                why = (
                    reply.error.reason
                    if reply.has_error()
                    else info_problem(reply.content.config_records.get("info"))
                )
                if why is None and int(reply.content["info"]["partition-id"]) in self.partition_of.values():
                    why = f"partition-id {reply.content['info']['partition-id']} is another node's"
                if why is not None:
                    log(
                        WARNING,
                        "SiFT: node %d did not say its partition id (%s); left out of the ring",
                        nid,
                        why,
                    )
                else:
                    self.partition_of[nid] = int(reply.content["info"]["partition-id"])
        return sorted((n for n in nodes if n in self.partition_of), key=lambda n: (self.partition_of[n], n))

    # -- one hop --------------------------------------------------------------------------
    def hop(self, grid: Grid, node: int, server_round: int, pair: dict[str, ArrayRecord]):
        """Send the pair to ``node`` and wait; returns (reply, None) or (None, why it was skipped)."""
        config = ConfigRecord({"server-round": server_round, "num-rounds": self.cfg.num_server_rounds})
        msg = Message(
            RecordDict({**pair, "config": config}), dst_node_id=node, message_type=MessageType.TRAIN
        )
        self.count_traffic(down=self.wire_bytes(msg.content), messages=1)
        replies = list(grid.send_and_receive([msg], timeout=self.hop_timeout))
        if not replies:
            return None, f"no reply within sift.hop-timeout={self.hop_timeout:g} s"
        reply = replies[0]
        if reply.has_error():
            return None, f"error: {reply.error.reason}"
        self.count_traffic(up=self.wire_bytes(reply.content), messages=1)
        problem = self.hop_problem(node, pair, reply)
        return (None, f"rejected: {problem}") if problem else (reply, None)

    def hop_problem(self, node: int, pair: dict[str, ArrayRecord], reply: Message) -> str | None:
        """Why a hop's reply must not be passed on, or None: the pair's records and ``metrics``
        only; every model of the pair with the keys, shapes and dtypes sent and finite values
        (``max-update-norm`` > 0: within that L2 distance of the pair sent, over both models);
        finite metrics, its ``partition-id`` its node's, ``num-examples`` at most the labelled
        images it declared at the handshake."""
        extra = sorted(set(reply.content.keys()) - {*pair, "metrics"})
        if extra:
            return f"records the method does not send: {extra[:3]}"
        for key, sent in pair.items():
            if problem := reply_problem(reply.content.array_records.get(key), sent):
                return f"{key}: {problem}"
        metrics = reply.content.metric_records.get("metrics")
        if metrics is None:
            return "no 'metrics' MetricRecord"
        problem = metrics_problem(metrics) or self.partition_problem(node, metrics, self.partition_of)
        if problem is None and "num-examples" in metrics:
            declared = "labelled images it declared at the handshake"
            problem = count_problem(
                "num-examples", metrics["num-examples"], self.declared(node, "labelled"), declared=declared
            )
        bound = self.cfg.max_update_norm
        if problem is None and bound > 0:
            norm = math.sqrt(sum(l2_distance(reply.content[k], sent) ** 2 for k, sent in pair.items()))
            if norm > bound:
                problem = f"its update's L2 norm {norm:.4g} exceeds max-update-norm = {bound:g}"
        return problem

    def train_round(
        self, grid: Grid, server_round: int, pair: dict[str, ArrayRecord]
    ) -> dict[str, ArrayRecord]:
        """One round of the ring: every client once, in partition-id order."""
        order = self.ring_order(grid)
        visited, skipped, per_client, peaks = [], {}, {}, {}
        for node in order:
            pid = self.partition_of[node]
            started = time.monotonic()
            reply, why = self.hop(grid, node, server_round, pair)
            if reply is None:
                skipped[str(pid)] = why
                if why.startswith("rejected: "):  # logged below; in summary.json's missing_clients too
                    entry = {
                        "stage": self.stage,
                        "round": server_round,
                        "partition-id": str(pid),
                        "node-id": node,
                    }
                    self.note("missing_clients", {**entry, "reason": why})
                log(
                    WARNING,
                    "SiFT round %d: skipping client %d (node %d): %s; the ring goes on",
                    server_round,
                    pid,
                    node,
                    why,
                )
                continue
            pair = {key: reply.content[key] for key in pair}
            metrics = dict(reply.content["metrics"])
            metrics.pop("partition-id", None)
            if wire.GPU_PEAK in metrics:  # client_app.dispatch on CUDA (summary.json gpu_peak_mib)
                peaks[str(pid)] = float(metrics.pop(wire.GPU_PEAK))
            per_client[str(pid)] = metrics
            visited.append(pid)
            log(
                INFO,
                "SiFT round %d: hop %d/%d client %d (node %d) · train loss %.3f · %.1f s (%.1f s on the "
                "client)",
                server_round,
                len(visited) + len(skipped),
                len(order),
                pid,
                node,
                metrics.get("train_loss", float("nan")),
                time.monotonic() - started,
                metrics.get("client-seconds", float("nan")),
            )
        if not visited:
            log(WARNING, "SiFT round %d: no client was visited; the models are unchanged", server_round)
        self.train_per_client = per_client
        if peaks:
            self.note_gpu_peaks(server_round, peaks)
        self.note(
            "ring",
            {
                "round": server_round,
                "order": [self.partition_of[n] for n in order],
                "visited": visited,
                "skipped": skipped,
            },
        )
        log(
            INFO,
            "SiFT round %d: visited clients %s%s",
            server_round,
            visited,
            f", skipped {sorted(skipped, key=int)}" if skipped else "",
        )
        return pair

    def inference_model(self, pair: dict[str, ArrayRecord]) -> ArrayRecord:
        """The long-term model (Eq. 2 accumulates it); the short-term one for ``single``."""
        return pair[LONG] if LONG in pair else pair[SHORT]

    # -- the round loop (strategies.common.run_rounds) drives the ring through these --------
    def configure_train(self, server_round, arrays, config, grid):
        """Run this round's whole ring here, one hop at a time (``arrays`` is the initial model
        in round 1); no message is left for a parallel send."""
        self._round_start = time.monotonic()
        if self.pair is None:
            self.pair = {SHORT: arrays}
            if self.variant != "single":
                self.pair[LONG] = wire.copy_record(arrays)  # Arrays are immutable: no data copy
        self.pair = self.train_round(grid, server_round, self.pair)
        return []

    def aggregate_train(self, server_round, replies):
        """The ring already ran in :meth:`configure_train`: hand back the model to evaluate."""
        return self.inference_model(self.pair), None

    def state_dict(self):
        return {
            **super().state_dict(),
            "partition_of": dict(self.partition_of),
            "pair": None if self.pair is None else {k: wire.to_state_dict(v) for k, v in self.pair.items()},
        }

    def load_state_dict(self, state):
        super().load_state_dict(state)
        # node ids are new in a resumed run: the partition ids come from this run's handshake
        self.pair = None if state["pair"] is None else {k: ArrayRecord(v) for k, v in state["pair"].items()}


def build_strategy(cfg, recorder) -> SiftStrategy:
    n = cfg.min_clients
    return SiftStrategy(
        cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
    )


def model_metadata(cfg) -> dict:
    """What ``fedderm.inference`` needs, beyond the model's name and size, to rebuild the
    text-guided classifier of a SiFT run's model files."""
    return {
        "network": "sift",
        "sift_variant": cfg.option("sift.variant"),
        "sift_temperature": float(cfg.option("sift.temperature")),
    }


def check_options(cfg) -> None:
    """Range checks of the ``sift.*`` keys (types are checked by the config parser)."""

    need(cfg, cfg.option("sift.variant") in VARIANTS, "sift.variant", f"must be one of {list(VARIANTS)}")
    need(cfg, 0 <= cfg.option("sift.ema-beta") < 1, "sift.ema-beta", "must be in [0, 1)")
    need(cfg, cfg.option("sift.temperature") > 0, "sift.temperature", "must be > 0")
    need(
        cfg,
        cfg.option("sift.text-pooling") in ("mean", "cls"),
        "sift.text-pooling",
        "must be 'mean' or 'cls'",
    )
    need(
        cfg,
        cfg.option("sift.long-bn") in LONG_BN_MODES,
        "sift.long-bn",
        f"must be one of {list(LONG_BN_MODES)}",
    )
    need(cfg, cfg.option("sift.hop-timeout") > 0, "sift.hop-timeout", "must be > 0 seconds")
    need(
        cfg,
        bool(cfg.option("sift.text-model").strip()) or cfg.option("sift.variant") == "trainable-head",
        "sift.text-model",
        "must name a local model folder, an installed model package or a hub model",
    )


def run(grid: Grid, cfg, recorder, classes: list[str]) -> None:
    """Embed the class texts (once), build the SiFT model, run the ring, test the long-term model."""
    check_options(cfg)
    embeddings = head_embeddings(cfg, classes)
    model = build_sift_model(
        cfg.model,
        embeddings,
        image_size=cfg.image_size,
        temperature=cfg.option("sift.temperature"),
        projector_seed=projector_seed(cfg),
        variant=cfg.option("sift.variant"),
    )
    recorder.update_extra(
        {
            "sift": {
                "variant": cfg.option("sift.variant"),
                "text_model": cfg.option("sift.text-model"),
                "class_texts": class_texts(cfg.option("sift.class-texts"), classes),
                "embedding_dim": int(embeddings.shape[1])
                if cfg.option("sift.variant") != "trainable-head"
                else None,
            }
        }
    )
    run_federated(build_strategy(cfg, recorder), grid, wire.to_record(model.state_dict()))
