"""FedAvg (McMahan et al. 2017): Flower's built-in strategy, weighted by ``num-examples``."""

from flwr.serverapp.strategy import FedAvg

from .common import Tracked
from .dp import ServerSideFixedClipping


class FedAvgStrategy(Tracked, FedAvg):
    """Flower's FedAvg with fedderm's per-client results and best-on-val tracking."""

    val_rides_train = True  # val-in-train: its clients evaluate with clients.common.evaluate_split


class PrivateFedAvgStrategy(ServerSideFixedClipping, FedAvgStrategy):
    """FedAvg with server-side fixed clipping + Gaussian noise (``dp.mode = "server"``)."""


def build_strategy(cfg, recorder) -> FedAvgStrategy:
    n = cfg.min_clients
    cls = PrivateFedAvgStrategy if cfg.option("dp.mode") == "server" else FedAvgStrategy
    return cls(cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n)
