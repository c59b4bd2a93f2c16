"""MOON (Li, He & Song 2021; baseline of paper 004): FedAvg of the 004 network; the
model-contrastive term is on the client (``clients.moon``)."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from .common import Tracked
from .flbt_family import PRCurves, projected_net, run_strategy


class MoonStrategy(PRCurves, Tracked, FedAvg):
    """Flower's FedAvg with per-client results, best-on-val tracking and PR curves."""


def build_strategy(cfg, recorder) -> MoonStrategy:
    n = cfg.min_clients
    return MoonStrategy(
        cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
    )


def run(grid, cfg, recorder, classes):
    run_strategy(build_strategy(cfg, recorder), grid, cfg, classes, projected_net(cfg, classes))
