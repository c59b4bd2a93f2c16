"""A centre held out of the federation (``holdout-centre``; paper 004 Table XI).

The ServerApp hands the method a :class:`HoldoutGrid`: the held-out node is not in its node list
and any message addressed to it is refused, so no strategy can train, evaluate or send a model to
it.  After the method has finished, :func:`finetune_holdout` sends the held-out centre the method's
final global model (the best-on-val ``model-best.pt`` its own test used, else ``model.pt``; a method
without a global model, ``local``, sends none and the centre starts from random weights) in one
``train.holdout`` message (``clients.holdout``), and records what comes back as rows
``holdout-val`` (per epoch) and ``holdout-test`` in ``rounds.csv`` and ``summary.json``'s ``holdout``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from fedderm.config import ConfigError
from fedderm.results import format_table
from wire import to_record

from .fastpoll import WrappedGrid
from .flbt_family import save_pr_curves

HOLDOUT = "train.holdout"
CURVES = ("val-balanced_accuracy", "val-accuracy", "train-loss")


class HoldoutError(RuntimeError):
    """A strategy tried to reach the held-out centre."""


class HoldoutGrid(WrappedGrid):
    """``grid`` without the nodes in ``hidden``: not listed, and no message may be sent to them."""

    def __init__(self, grid: Grid, hidden: Iterable[int]):
        super().__init__(grid)
        self.hidden = frozenset(int(n) for n in hidden)

    def _check(self, messages) -> list[Message]:
        messages = list(messages)
        bad = sorted({m.metadata.dst_node_id for m in messages} & self.hidden)
        if bad:
            raise HoldoutError(
                f"a message of the federation was addressed to the held-out centre (node {bad}); "
                "holdout-centre must never take part in training or evaluation"
            )
        return messages

    def get_node_ids(self):
        return [n for n in self.inner.get_node_ids() if n not in self.hidden]

    def get_nodes(self):
        return [n for n in self.inner.get_nodes() if getattr(n, "node_id", n) not in self.hidden]

    def push_messages(self, messages):
        return self.inner.push_messages(self._check(messages))

    def send_and_receive(self, messages, *, timeout=None):
        return self.inner.send_and_receive(self._check(messages), timeout=timeout)


def holdout_nodes(cfg, infos: Mapping[int, Mapping]) -> list[int]:
    """Node ids of the centre ``holdout-centre`` names (its partition-id or node-config ``site``);
    [] when it is off.  Raises naming the key when no connected centre matches."""
    want = cfg.holdout_centre.strip()
    if not want:
        return []
    found = [
        nid for nid, info in infos.items() if want in (str(info["partition-id"]), str(info.get("site") or ""))
    ]
    if not found:
        known = sorted(
            f"{info['partition-id']}" + (f" ({info['site']})" if info.get("site") else "")
            for info in infos.values()
        )
        raise ConfigError(
            f"run-config key 'holdout-centre'={want!r} matches no connected centre; "
            f"centres (partition-id (site)): {known}"
        )
    return found


def start_weights(recorder) -> tuple[ArrayRecord, str]:
    """The method's final global model from its run folder and which file it came from."""
    for name in ("model-best.pt", "model.pt"):
        path = recorder.run_dir / name
        if path.exists():
            state = torch.load(path, map_location="cpu", weights_only=True)
            if state:
                return to_record(state), name
    return ArrayRecord(), "random"


def finetune_holdout(grid: Grid, cfg, recorder, node_id: int, classes: list[str] | None = None) -> dict:
    """Send the final global model to the held-out centre, let it fine-tune and test; record the result."""
    arrays, start = start_weights(recorder)
    log(
        INFO,
        "held-out centre (node %d): fine-tuning %s for %d epochs",
        node_id,
        "the global model " + start
        if start != "random"
        else "from random weights (the method has no global model)",
        cfg.holdout_epochs,
    )
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 0})})
    replies = list(
        grid.send_and_receive(
            [Message(content, dst_node_id=node_id, message_type=HOLDOUT)],
            timeout=max(cfg.round_timeout, 600.0),
        )
    )
    if not replies or replies[0].has_error():
        reason = replies[0].error.reason if replies else f"no reply within {cfg.round_timeout:g} s"
        raise RuntimeError(f"held-out centre (node {node_id}) failed to fine-tune: {reason}")
    reply = replies[0]
    metrics = dict(reply.content["metrics"])
    claim = metrics.pop("partition-id", node_id)  # filed under the partition the handshake gave the node
    pid = str(recorder.node_partitions.get(node_id, claim))
    save_pr_curves(recorder, [(pid, reply)], classes, f"{cfg.method} → held-out centre")
    curves = {k: [float(v) for v in metrics.pop(k, [])] for k in CURVES}
    best_epoch = int(metrics.pop("best-epoch"))
    metrics.pop("start", None)
    kept_own = int(metrics.pop("own-init-arrays", 0))
    for epoch, (bacc, acc) in enumerate(
        zip(curves["val-balanced_accuracy"], curves["val-accuracy"]), start=1
    ):
        recorder.log_round(
            epoch,
            "holdout-val",
            {pid: {"balanced_accuracy": bacc, "accuracy": acc}},
            train={"train_loss": curves["train-loss"][epoch - 1]},
        )
    recorder.log_round(best_epoch, "holdout-test", {pid: metrics})
    result = {
        "centre": pid,
        "node-id": int(node_id),
        "start": start,
        "epochs": cfg.holdout_epochs,
        "lr": cfg.holdout_lr,
        "best_epoch": best_epoch,
        "arrays_not_transferred": kept_own,
        "val_curve": curves["val-balanced_accuracy"],
        "final": {**metrics, "per_client": {pid: metrics}},
    }
    recorder.update_extra({"holdout": result})
    table = format_table(
        {pid: metrics},
        f"Held-out centre {pid}: {cfg.method}'s global model ({start}) "
        f"fine-tuned {cfg.holdout_epochs} epochs, test of epoch {best_epoch}",
    )
    (recorder.run_dir / "holdout_table.txt").write_text(table + "\n")
    log(INFO, "\n%s", table)
    return result
