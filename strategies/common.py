"""What every fedderm strategy shares: per-client bookkeeping, best-on-val tracking, the
round-0 / per-round / final-test evaluation plan, and the results folder.

A method's strategy is a Flower strategy with :class:`Tracked` mixed in front of it, e.g.
``class FedAvgStrategy(Tracked, FedAvg)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid

from fedderm.config import Config
from fedderm.metrics import SELECTION_METRIC
from fedderm.results import RunRecorder


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """MetricRecord-safe copy: NaN (e.g. AUC with one class present) is left out."""
    return {k: float(v) for k, v in metrics.items() if v == v}


class Tracked:
    """Mixin for a Flower strategy: records per-client metrics and keeps the best model on val.

    Clients put their ``partition-id`` in every reply's MetricRecord; it is taken out before
    Flower's weighted averaging and used to key per-client rows in the results.
    """

    def __init__(self, *, cfg: Config, recorder: RunRecorder, action: str = "",
                 num_rounds: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.cfg, self.recorder = cfg, recorder
        self.action = action  # train messages go out as "train.<action>" (e.g. train.pretrain)
        self.num_rounds = cfg.num_server_rounds if num_rounds is None else num_rounds
        self.split = "val"
        self.train_per_client: dict[str, dict[str, float]] = {}
        self.best_round: int | None = None
        self.best_score = float("-inf")
        self.best_arrays: ArrayRecord | None = None
        self.last_mean: dict[str, float] = {}
        self._round_start = time.monotonic()

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
        config["num-rounds"] = self.num_rounds
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if self.action:
            for msg in messages:
                msg.metadata.message_type = f"{MessageType.TRAIN}.{self.action}"
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        self.train_per_client = self._per_client(replies)
        return super().aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round, arrays, config, grid):
        self.split = str(config.get("split", "val"))
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        if not replies:  # nothing was sent (e.g. no evaluation during pre-training)
            return None
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
        log(INFO, "%sround %d/%d · val %s %.3f · accuracy %.3f · train loss %s · best %.3f @ round %s · %.1f s",
            f"{self.action} " if self.action else "", server_round, self.num_rounds, SELECTION_METRIC, score,
            self.last_mean.get("accuracy", float("nan")),
            f"{train['train_loss']:.3f}" if train else "-", self.best_score, self.best_round,
            time.monotonic() - self._round_start)


def _mean_train_loss(per_client: dict[str, dict[str, float]]) -> dict[str, float] | None:
    losses = [m["train_loss"] for m in per_client.values() if "train_loss" in m]
    return {"train_loss": sum(losses) / len(losses)} if losses else None


def run_federated(strategy: Tracked, grid: Grid, initial_arrays: ArrayRecord, timeout: float = 3600):
    """Round 0 on val, ``strategy.num_rounds`` rounds of train + val, then test with the
    best-on-val model; saves ``model.pt`` (final) and ``model-best.pt``.

    Returns Flower's ``Result`` (final global model in ``result.arrays``).
    """

    def on_round(server_round: int, arrays: ArrayRecord) -> None:
        if server_round == 0:
            strategy._round_start = time.monotonic()
            strategy.evaluate_round(grid, 0, arrays, "val", timeout)
        strategy.after_round(server_round, arrays)

    result = strategy.start(grid, initial_arrays, num_rounds=strategy.num_rounds, timeout=timeout,
                            train_config=ConfigRecord(), evaluate_config=ConfigRecord({"split": "val"}),
                            evaluate_fn=on_round)
    final = result.arrays if len(result.arrays) else initial_arrays
    best = strategy.best_arrays or final
    log(INFO, "testing the best model on val (round %s) on every client's test split", strategy.best_round)
    strategy.evaluate_round(grid, strategy.num_rounds, best, "test", timeout)
    strategy.recorder.save_model(final.to_torch_state_dict())
    strategy.recorder.save_model(best.to_torch_state_dict(), name="model-best.pt")
    return result
