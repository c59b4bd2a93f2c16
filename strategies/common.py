"""What every fedderm strategy shares: per-client bookkeeping, best-on-val tracking, the
round-0 / per-round / final-test evaluation plan, and the results folder.

A method's strategy is a Flower strategy with :class:`Tracked` mixed in front of it, e.g.
``class FedAvgStrategy(Tracked, FedAvg)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid

from fedderm.config import Config
from fedderm.results import RunRecorder

SELECTION_METRIC = "balanced_accuracy"
POLL_INTERVAL = 0.1  # seconds between pulls in send_and_receive_fast


def send_and_receive_fast(grid: Grid, messages: Iterable[Message], timeout: float | None = None,
                          poll_interval: float = POLL_INTERVAL) -> list[Message]:
    """``grid.send_and_receive`` that checks for replies every ``poll_interval`` seconds.

    Flower's deployment grid (``HttpGrid``) sleeps 3 s between pulls, so every message
    exchange (a round's train or evaluate wave, every hop of a ring) ends up to 3 s after the
    last reply arrived.  This pushes ``messages``, then pulls every ``poll_interval`` s until each
    has a reply or ``timeout`` (s; None waits forever) has passed, and returns the replies
    received (like Flower: missing replies are simply absent).  Works on any Grid (simulation's
    ``InMemoryGrid`` too).
    """
    pushed = list(grid.push_messages(list(messages)))
    pending = {mid for mid in pushed if mid}
    if len(pending) < len(pushed):
        log(WARNING, "send_and_receive_fast: %d of %d messages could not be pushed",
            len(pushed) - len(pending), len(pushed))
    end = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending:
            break
        if end is not None and time.monotonic() >= end:
            break
        time.sleep(poll_interval if end is None else max(0.0, min(poll_interval, end - time.monotonic())))
    return replies


class FastPollGrid(Grid):
    """A Grid whose ``send_and_receive`` is :func:`send_and_receive_fast`; all else delegated.

    The ServerApp wraps Flower's grid in it once, so every strategy (and Flower's own
    ``Strategy.start``) gets replies within ``poll_interval`` of their arrival.
    """

    def __init__(self, grid: Grid, poll_interval: float = POLL_INTERVAL):
        self.inner, self.poll_interval = grid, poll_interval

    def set_run(self, run):
        return self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, *args, **kwargs):
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def get_nodes(self):
        return self.inner.get_nodes()

    def push_messages(self, messages):
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids):
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return send_and_receive_fast(self.inner, messages, timeout, self.poll_interval)

    def __getattr__(self, name):  # anything else a concrete grid offers
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


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
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        self.train_per_client = self._per_client(replies)
        return super().aggregate_train(server_round, replies)

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
    strategy.recorder.save_model(final.to_torch_state_dict())
    strategy.recorder.save_model(best.to_torch_state_dict(), name="model-best.pt")
    return result
