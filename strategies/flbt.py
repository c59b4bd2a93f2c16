"""FL-BT (paper 004 §III-B): FedAvg weighted by image count (Eq. 10) of the 004 network; the
server tells the clients μ (``flbt-mu``), so SSL-FL's FedAvg stage is the same strategy with μ = 0.

Also what the 004 strategies share: PR-curve PNGs per centre from the final test and the run
plan for the 004 network.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedderm.flbt import build_projected_net
from fedderm.prcurves import plot_pr_curves

from .common import Tracked, run_federated


def save_pr_curves(recorder, replies: list[Message], classes: list[str] | None, method: str) -> list:
    """Draw ``pr_curve_client<id>.png`` for every test reply carrying a ``pr-curve`` record."""
    paths = []
    for msg in replies:
        if msg.has_error() or "pr-curve" not in msg.content:
            continue
        pid = msg.content["metrics"].get("partition-id", msg.metadata.src_node_id)
        curves = {k: (list(v) if isinstance(v, list) else v) for k, v in msg.content["pr-curve"].items()}
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


class FLBTStrategy(PRCurves, Tracked, FedAvg):
    """FedAvg (Flower) + per-client results + PR curves; sends μ of Eq. 7 with every round."""

    def __init__(self, *, mu: float, **kwargs):
        super().__init__(**kwargs)
        self.mu = float(mu)

    def configure_train(self, server_round, arrays, config, grid):
        config["flbt-mu"] = self.mu
        return super().configure_train(server_round, arrays, config, grid)


def build_strategy(cfg, recorder, mu: float | None = None) -> FLBTStrategy:
    """FL-BT with μ = ``flbt.mu`` (or ``mu``: 0 for FedAvg on the 004 network).  The option
    ranges are checked when the config is parsed (``registry.check_flbt``)."""
    mu = cfg.option("flbt.mu") if mu is None else mu
    n = cfg.min_clients
    return FLBTStrategy(mu=mu, cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n,
                        min_available_nodes=n)


def projected_net(cfg, classes: list[str]):
    return build_projected_net(cfg.model, len(classes), cfg.image_size, int(cfg.option("flbt.proj-dim")))


def run_strategy(strategy, grid: Grid, cfg, classes: list[str], model) -> None:
    strategy.classes = classes
    run_federated(strategy, grid, ArrayRecord(model.state_dict()))


def run(grid: Grid, cfg, recorder, classes: list[str]) -> None:
    """FL-BT from random weights: encoder + projector + output layer (004 Fig. 4)."""
    run_strategy(build_strategy(cfg, recorder), grid, cfg, classes, projected_net(cfg, classes))
