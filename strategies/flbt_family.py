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


def pr_curves_of(replies: list[tuple[str, Message]]) -> list[tuple]:
    """``(partition id, curves)`` of every screened test reply carrying a ``pr-curve`` record, each
    given with the partition id the handshake gave its node."""
    found = []
    for pid, msg in replies:
        if msg.has_error() or PR_CURVE not in msg.content:
            continue
        found.append(
            (pid, {k: (list(v) if isinstance(v, list) else v) for k, v in msg.content[PR_CURVE].items()})
        )
    return found


def draw_pr_curves(recorder, curves: list[tuple], classes: list[str] | None, method: str) -> list:
    """Draw ``pr_curve_client<id>.png`` for every ``(partition id, curves)`` pair."""
    return [
        plot_pr_curves(
            recorder.run_dir / f"pr_curve_client{pid}.png", c, classes, f"{method}: centre {pid}, test split"
        )
        for pid, c in curves
    ]


def save_pr_curves(
    recorder, replies: list[tuple[str, Message]], classes: list[str] | None, method: str
) -> list:
    """Draw ``pr_curve_client<id>.png`` for every ``(partition id, test reply)`` carrying a ``pr-curve`` record."""
    return draw_pr_curves(recorder, pr_curves_of(replies), classes, method)


class PRCurves:
    """Strategy mixin (in front of :class:`Tracked`): PR-curve PNGs from the final test replies.

    Flower's hook only keeps the curves; they are drawn when the round loop records the test
    (:meth:`Tracked.record_evaluation`)."""

    classes: list[str] | None = None
    _pr_curves: list = []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        self.eval_accepted = []
        result = super().aggregate_evaluate(server_round, replies)
        # the replies that passed screening, under the partition ids the handshake gave their nodes
        self._pr_curves = pr_curves_of(self.eval_accepted) if self.split == "test" else []
        return result

    def record_evaluation(self, server_round: int, per_client: dict) -> dict:
        draw_pr_curves(self.recorder, self._pr_curves, self.classes, self.cfg.method)
        self._pr_curves = []
        return super().record_evaluation(server_round, per_client)


def projected_net(cfg, classes: list[str]):
    """The 004 network (encoder + projector of ``flbt.proj-dim`` + output layer, 004 Fig. 4)."""
    return build_projected_net(cfg.model, len(classes), cfg.image_size, int(cfg.option("flbt.proj-dim")))


def run_strategy(strategy, grid: Grid, cfg, classes: list[str], model) -> None:
    """Run ``strategy`` from ``model``'s weights (PR curves labelled with ``classes``)."""
    strategy.classes = classes
    run_federated(strategy, grid, to_record(model.state_dict()))
