"""Server side of the paper-004 family (FL-BT, SSL-FL-BT, FedBN, MOON, local training and the
held-out centre): PR-curve PNGs per centre from the final test replies (004 §IV, Fig. 8), the
004 network (encoder + projector + output layer, 004 Fig. 4) and its federated run.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

from fedderm.flbt import build_projected_net
from fedderm.prcurves import plot_pr_curves
from wire import PR_CURVE, to_record

from .common import run_federated


def save_pr_curves(recorder, replies: list[Message], classes: list[str] | None, method: str) -> list:
    """Draw ``pr_curve_client<id>.png`` for every test reply carrying a ``pr-curve`` record."""
    paths = []
    for msg in replies:
        if msg.has_error() or PR_CURVE not in msg.content:
            continue
        pid = msg.content["metrics"].get("partition-id", msg.metadata.src_node_id)
        curves = {k: (list(v) if isinstance(v, list) else v) for k, v in msg.content[PR_CURVE].items()}
        paths.append(plot_pr_curves(recorder.run_dir / f"pr_curve_client{pid}.png", curves, classes,
                                    f"{method}: centre {pid}, test split"))
    return paths


class PRCurves:
    """Strategy mixin (in front of :class:`Tracked`): PR-curve PNGs from the final test replies."""

    classes: list[str] | None = None

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        if self.split == "test":  # before Tracked pops partition-id from the metrics
            save_pr_curves(self.recorder, replies, self.classes, self.cfg.method)
        return super().aggregate_evaluate(server_round, replies)


def projected_net(cfg, classes: list[str]):
    """The 004 network (encoder + projector of ``flbt.proj-dim`` + output layer, 004 Fig. 4)."""
    return build_projected_net(cfg.model, len(classes), cfg.image_size, int(cfg.option("flbt.proj-dim")))


def run_strategy(strategy, grid: Grid, cfg, classes: list[str], model) -> None:
    """Run ``strategy`` from ``model``'s weights (PR curves labelled with ``classes``)."""
    strategy.classes = classes
    run_federated(strategy, grid, to_record(model.state_dict()))
