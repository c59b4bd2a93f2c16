"""FL-BT (paper 004 §III-B): FedAvg weighted by image count (Eq. 10) of the 004 network; the
server tells the clients μ (``flbt-mu``), so SSL-FL's FedAvg stage is the same strategy with μ = 0.

What the 004 family shares (PR curves, the 004 network, the run) is in
:mod:`strategies.flbt_family`.
"""

from __future__ import annotations

from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from .common import Tracked
from .flbt_family import PRCurves, projected_net, run_strategy


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
    ranges are checked when the config is parsed (``check_flbt`` in ``methods/flbt.py``)."""
    mu = cfg.option("flbt.mu") if mu is None else mu
    n = cfg.min_clients
    return FLBTStrategy(
        mu=mu, cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
    )


def run(grid: Grid, cfg, recorder, classes: list[str]) -> None:
    """FL-BT from random weights: encoder + projector + output layer (004 Fig. 4)."""
    run_strategy(build_strategy(cfg, recorder), grid, cfg, classes, projected_net(cfg, classes))
