"""What every fedderm strategy shares: per-client bookkeeping, best-on-val tracking, the
round-0 / per-round / final-test evaluation plan, and the results folder.

A method's strategy is a Flower strategy with :class:`Tracked` mixed in front of it, e.g.
``class FedAvgStrategy(Tracked, FedAvg)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from fedderm.config import Config
from fedderm.results import RunRecorder

SELECTION_METRIC = "balanced_accuracy"


def array_bytes(content: RecordDict) -> int:
    """Bytes of every ArrayRecord in a message's content (Flower's ``ArrayRecord.count_bytes``)."""
    return sum(record.count_bytes() for record in content.array_records.values())


def rounds_to_target(rounds: list[dict], targets: list[float], split: str = "val",
                     metric: str = SELECTION_METRIC) -> dict[str, int | None]:
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


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """MetricRecord-safe copy: NaN (e.g. AUC with one class present) is left out."""
    return {k: float(v) for k, v in metrics.items() if v == v}


class Tracked:
    """Mixin for a Flower strategy: records per-client metrics and keeps the best model on val.

    Clients put their ``partition-id`` in every reply's MetricRecord; it is taken out before
    Flower's weighted averaging and used to key per-client rows in the results.
    """

    def __init__(self, *, cfg: Config, recorder: RunRecorder, **kwargs):
        super().__init__(**kwargs)
        self.cfg, self.recorder = cfg, recorder
        self.split = "val"
        self.train_per_client: dict[str, dict[str, float]] = {}
        self.best_round: int | None = None
        self.best_score = float("-inf")
        self.best_arrays: ArrayRecord | None = None
        self.last_mean: dict[str, float] = {}
        self._round_start = time.monotonic()
        #: bytes of model traffic of the current round (``down``: server -> clients, ``up``:
        #: clients -> server, ``messages``); strategies with extra records add to it.
        self.traffic: dict[str, int] | None = None
        self.traffic_log: list[dict[str, int]] = []

    @staticmethod
    def _per_client(replies: list[Message]) -> dict[str, dict[str, float]]:
        per_client = {}
        for msg in replies:
            if msg.has_error():
                continue
            metrics = msg.content["metrics"]
            pid = str(metrics.pop("partition-id", msg.metadata.src_node_id))
            per_client[pid] = dict(metrics)
        return dict(sorted(per_client.items(), key=lambda kv: int(kv[0])))

    def configure_train(self, server_round, arrays, config, grid):
        self._round_start = time.monotonic()
        config["num-rounds"] = self.cfg.num_server_rounds
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        self.count_traffic(down=sum(array_bytes(m.content) for m in msgs), messages=len(msgs))
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        ok = [r for r in replies if not r.has_error()]
        self.count_traffic(up=sum(array_bytes(r.content) for r in ok), messages=len(ok))
        self.train_per_client = self._per_client(replies)
        return super().aggregate_train(server_round, replies)

    def count_traffic(self, *, down: int = 0, up: int = 0, messages: int = 0) -> None:
        """Add model traffic to the current round's count (logged and recorded by after_round)."""
        if self.traffic is None:
            self.traffic = {"down": 0, "up": 0, "messages": 0}
        self.traffic["down"] += int(down)
        self.traffic["up"] += int(up)
        self.traffic["messages"] += int(messages)

    def configure_evaluate(self, server_round, arrays, config, grid):
        self.split = str(config.get("split", "val"))
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        per_client = self._per_client(replies)
        super().aggregate_evaluate(server_round, replies)  # logs failures, checks consistency
        if not per_client:
            log(WARNING, "round %d: no client returned %s metrics", server_round, self.split)
            return None
        if self.split == "test":
            self.last_mean = self.recorder.set_final(per_client, self.best_round)
        else:
            train = {pid: m for pid, m in self.train_per_client.items()}
            self.last_mean = self.recorder.log_round(server_round, self.split, per_client,
                                                     train=_mean_train_loss(train))
        return MetricRecord(_finite(self.last_mean))

    # -- the evaluation plan ------------------------------------------------------------
    def evaluate_round(self, grid: Grid, server_round: int, arrays: ArrayRecord, split: str,
                       timeout: float) -> dict[str, float]:
        """Send ``arrays`` to every client for evaluation on ``split``; return the mean metrics."""
        msgs = self.configure_evaluate(server_round, arrays, ConfigRecord({"split": split}), grid)
        self.aggregate_evaluate(server_round, grid.send_and_receive(msgs, timeout=timeout))
        return self.last_mean

    def after_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """Called with the global model after every round (and round 0): best-on-val, progress."""
        score = self.last_mean.get(SELECTION_METRIC, float("nan"))
        if score == score and score > self.best_score:
            self.best_round, self.best_score = server_round, score
            self.best_arrays = ArrayRecord(arrays.to_torch_state_dict())
        train = _mean_train_loss(self.train_per_client)
        if self.traffic is not None and server_round > 0:
            t = self.traffic
            log(INFO, "round %d: bytes sent %d (%.2f MB: server->clients %.2f MB, clients->server %.2f MB, "
                "%d messages)", server_round, t["down"] + t["up"], (t["down"] + t["up"]) / 2**20,
                t["down"] / 2**20, t["up"] / 2**20, t["messages"])
            self.traffic_log.append({"round": server_round, "bytes": t["down"] + t["up"], **t})
            self.recorder.update_extra({"bytes_per_round": self.traffic_log})
        self.traffic = None
        log(INFO, "round %d/%d · val %s %.3f · accuracy %.3f · train loss %s · best %.3f @ round %s · %.1f s",
            server_round, self.cfg.num_server_rounds, SELECTION_METRIC, score,
            self.last_mean.get("accuracy", float("nan")),
            f"{train['train_loss']:.3f}" if train else "-", self.best_score, self.best_round,
            time.monotonic() - self._round_start)


def _mean_train_loss(per_client: dict[str, dict[str, float]]) -> dict[str, float] | None:
    losses = [m["train_loss"] for m in per_client.values() if "train_loss" in m]
    return {"train_loss": sum(losses) / len(losses)} if losses else None


def run_federated(strategy: Tracked, grid: Grid, initial_arrays: ArrayRecord, timeout: float = 3600):
    """Round 0 on val, ``num-server-rounds`` of train + val, then test with the best-on-val model.

    Returns Flower's ``Result`` (final global model in ``result.arrays``).
    """
    cfg = strategy.cfg

    def on_round(server_round: int, arrays: ArrayRecord) -> None:
        if server_round == 0:
            strategy._round_start = time.monotonic()
            strategy.evaluate_round(grid, 0, arrays, "val", timeout)
        strategy.after_round(server_round, arrays)

    result = strategy.start(grid, initial_arrays, num_rounds=cfg.num_server_rounds, timeout=timeout,
                            train_config=ConfigRecord(), evaluate_config=ConfigRecord({"split": "val"}),
                            evaluate_fn=on_round)
    final = result.arrays if len(result.arrays) else initial_arrays
    best = strategy.best_arrays or final
    log(INFO, "testing the best model on val (round %s) on every client's test split", strategy.best_round)
    strategy.evaluate_round(grid, cfg.num_server_rounds, best, "test", timeout)
    reached = rounds_to_target(strategy.recorder.rounds, cfg.target_list)
    strategy.recorder.update_extra({"rounds_to_target": reached})
    log(INFO, "rounds to reach mean val %s %s: %s", SELECTION_METRIC,
        ", ".join(reached) or "(no targets)", ", ".join(str(v) for v in reached.values()) or "-")
    strategy.recorder.save_model(final.to_torch_state_dict())
    strategy.recorder.save_model(best.to_torch_state_dict(), name="model-best.pt")
    return result
