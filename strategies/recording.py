"""The record step of a round (:func:`strategies.common.run_rounds`): what a round's Flower hooks
found, and the round's costs, are noted in :class:`RoundNotes`, and :class:`Recording` writes them,
with the round's evaluation and the best-on-val model, into the results
(:class:`fedderm.results.RunRecorder`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import ArrayRecord
from flwr.common import log

import wire
from fedderm.metrics import SELECTION_METRIC, mean_over_clients
from fedderm.results import client_sort_key

from . import progress


@dataclass
class RoundNotes:
    """What a round's Flower hooks found for the results, and the round's costs, kept until the round
    loop records them (:meth:`Recording.record_notes`): entries of summary.json lists
    (``missing_clients``, ``gpu_peak_mib``, ``round_seconds``, ``bytes_per_round``,
    ``model_privacy``, ...), extra rounds.csv splits (``leakage-audit``) and TensorBoard scalars."""

    entries: list[tuple[str, dict]] = field(default_factory=list)
    splits: list[tuple[int, str, dict[str, dict[str, float]]]] = field(default_factory=list)
    scalars: list[tuple[str, int, dict[str, float]]] = field(default_factory=list)


def missing_entries(recorder, stage: str, server_round: int, missing: list[tuple[int, str]]) -> list[dict]:
    """Log the clients left out of ``stage``'s ``server_round`` (``missing``: (node id, reason) pairs)
    and return their ``summary.json`` ``missing_clients`` entries."""
    entries = []
    for node, why in missing:
        pid = str(recorder.node_partitions.get(node, f"node {node}"))
        log(WARNING, "%s round %d: client %s (node %d) left out: %s", stage, server_round, pid, node, why)
        entries.append(
            {"stage": stage, "round": server_round, "partition-id": pid, "node-id": node, "reason": why}
        )
    return entries


def record_missing(recorder, stage: str, server_round: int, missing: list[tuple[int, str]]) -> None:
    """:func:`missing_entries`, written into ``summary.json`` at once: for the steps outside a
    strategy's round (probes, pseudo images, local training)."""
    entries = missing_entries(recorder, stage, server_round, missing)
    if entries:
        recorder.update_extra({"missing_clients": [*recorder.extra.get("missing_clients", []), *entries]})


class Recording:
    """Mixin of :class:`strategies.common.Tracked`: notes what the hooks find and records it once
    per round.  Uses the strategy's ``recorder``, ``stage``, ``action``, ``num_rounds``, ``split``,
    ``notes``, ``traffic``, ``round_seconds``, ``train_per_client``, ``last_mean`` and ``best_*``,
    which :class:`~strategies.common.Tracked` sets up."""

    def _partition(self, node_id: int) -> str:
        return str(self.recorder.node_partitions.get(node_id, f"node {node_id}"))

    def note_missing(self, server_round: int, missing: list[tuple[int, str]]) -> None:
        """Log the clients left out of ``server_round`` and note them for ``summary.json``
        (``missing_clients``): ``missing`` holds (node id, reason) pairs."""
        for entry in missing_entries(self.recorder, self.stage, server_round, missing):
            self.note("missing_clients", entry)

    def note_gpu_peaks(self, server_round: int | None, peaks: dict[str, float]) -> None:
        """Note each client's peak CUDA memory of this round's messages (summary.json ``gpu_peak_mib``)."""
        ordered = dict(sorted(peaks.items(), key=lambda kv: client_sort_key(kv[0])))
        self.note("gpu_peak_mib", {"stage": self.stage, "round": server_round, "per_client": ordered})

    def note(self, key: str, entry: dict) -> None:
        """Note one more entry of the summary.json list ``key`` (e.g. ``model_privacy``)."""
        self.notes.entries.append((key, entry))

    def note_split(
        self, server_round: int, split: str, per_client: dict[str, dict[str, float]]
    ) -> dict[str, float]:
        """Note per-client metrics of an extra rounds.csv ``split`` (e.g. ``leakage-audit``); returns their mean."""
        self.notes.splits.append((server_round, split, per_client))
        return mean_over_clients(per_client)

    def note_scalars(self, tag: str, server_round: int, values: dict[str, float]) -> None:
        """Note TensorBoard scalars (``tracking = true``) of ``server_round``."""
        self.notes.scalars.append((tag, server_round, values))

    def record_notes(self) -> None:
        """The round's notes into the results (summary.json lists, rounds.csv rows, TensorBoard
        scalars), each kind in the order noted; then a fresh :class:`RoundNotes`."""
        notes, self.notes = self.notes, RoundNotes()
        lists: dict[str, list] = {}
        for key, entry in notes.entries:
            lists[key] = [*lists.get(key, self.recorder.extra.get(key, [])), entry]
        if lists:
            self.recorder.update_extra(lists)
        for server_round, split, per_client in notes.splits:
            self.recorder.log_round(server_round, split, per_client)
        for tag, server_round, values in notes.scalars:
            self.recorder.track(tag, server_round, values)

    def count_traffic(self, *, down: int = 0, up: int = 0, messages: int = 0) -> None:
        """Add model traffic to the current round's count (logged and noted by :meth:`note_costs`)."""
        if self.traffic is None:
            self.traffic = {"down": 0, "up": 0, "messages": 0}
        self.traffic["down"] += int(down)
        self.traffic["up"] += int(up)
        self.traffic["messages"] += int(messages)

    def record_evaluation(
        self, server_round: int, per_client: dict[str, dict[str, float]]
    ) -> dict[str, float]:
        """Hand one evaluation's per-client metrics to the results module; returns their mean."""
        if self.split == "test":
            return self.recorder.set_final(per_client, self.best_round)
        return self.recorder.log_round(
            server_round, self.split, per_client, train=_mean_train_loss(self.train_per_client)
        )

    def note_costs(self, server_round: int, seconds: float | None = None) -> None:
        """Note the round's wall time and model traffic (summary.json ``round_seconds`` and
        ``bytes_per_round``, every stage's rounds, pre-training included: :func:`run_rounds` calls it
        for every round, whichever ``on_round`` it was given).  ``seconds``: the round's wall time
        (default: since :meth:`configure_train`)."""
        if self.traffic is not None and server_round > 0:
            t = self.traffic
            log(
                INFO,
                "%s round %d: bytes sent %d (%.2f MB: server->clients %.2f MB, clients->server %.2f MB, "
                "%d messages)",
                self.stage,
                server_round,
                t["down"] + t["up"],
                (t["down"] + t["up"]) / 2**20,
                t["down"] / 2**20,
                t["up"] / 2**20,
                t["messages"],
            )
            self.note(
                "bytes_per_round",
                {"stage": self.stage, "round": server_round, "bytes": t["down"] + t["up"], **t},
            )
        self.traffic = None
        seconds = time.monotonic() - self._round_start if seconds is None else seconds
        self.round_seconds = round(seconds, 3)
        self.note(
            "round_seconds", {"stage": self.stage, "round": server_round, "seconds": self.round_seconds}
        )

    def after_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """Called with the global model after every round (and round 0): best-on-val, progress."""
        score = self.last_mean.get(SELECTION_METRIC, float("nan"))
        if score == score and score > self.best_score:
            self.best_round, self.best_score = server_round, score
            self.best_arrays = wire.copy_record(arrays)  # Arrays are immutable: no data copy
        train = _mean_train_loss(self.train_per_client)
        left = progress.of(self.recorder).finish_round(self.stage, server_round)
        fields = [
            (f"val {progress.metric_label(SELECTION_METRIC)}", f"{score:.3f}"),
            ("val accuracy", f"{self.last_mean.get('accuracy', float('nan')):.3f}"),
            ("train loss", f"{train['train_loss']:.3f}" if train else "-"),
            ("best val", f"{self.best_score:.3f} (round {self.best_round})"),
        ]
        line = progress.round_line(
            self.action,
            server_round,
            self.num_rounds,
            fields,
            self.round_seconds if server_round > 0 else None,
            left,
        )
        log(INFO, "%s", line)


def _mean_train_loss(per_client: dict[str, dict[str, float]]) -> dict[str, float] | None:
    losses = [m["train_loss"] for m in per_client.values() if "train_loss" in m]
    return {"train_loss": sum(losses) / len(losses)} if losses else None
