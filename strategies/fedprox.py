"""FedProx (Li et al. 2020): Flower's built-in strategy; it sends ``proximal-mu`` to the clients,
whose local loss adds (μ/2)‖w − w_global‖² (``fedderm.train.train_supervised``)."""

from flwr.serverapp.strategy import FedProx

from .common import Tracked
from .dp import ServerSideFixedClipping


class FedProxStrategy(Tracked, FedProx):
    """Flower's FedProx with fedderm's per-client results and best-on-val tracking."""

    val_rides_train = True  # val-in-train: its clients evaluate with clients.common.evaluate_split


class PrivateFedProxStrategy(ServerSideFixedClipping, FedProxStrategy):
    """FedProx with server-side fixed clipping + Gaussian noise (``dp.mode = "server"``)."""


def build_strategy(cfg, recorder) -> FedProxStrategy:
    n = cfg.min_clients
    cls = PrivateFedProxStrategy if cfg.option("dp.mode") == "server" else FedProxStrategy
    return cls(
        cfg=cfg,
        recorder=recorder,
        proximal_mu=cfg.proximal_mu,
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
    )
