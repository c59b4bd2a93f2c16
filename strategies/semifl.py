"""Semi-FL (Yang et al. 2021, as 003 Fig. 10b uses it): FedAvg (weighted by the clients' labelled
images) of the classifiers trained with the labelled loss plus the consistency loss on the
clients' unlabelled images (:mod:`clients.semifl`); the default plan (train, then test)."""

from flwr.serverapp.strategy import FedAvg

from .common import Tracked


class SemiFLStrategy(Tracked, FedAvg):
    """Flower's FedAvg with fedderm's per-client results and best-on-val tracking."""


def build_strategy(cfg, recorder) -> SemiFLStrategy:
    n = cfg.min_clients
    return SemiFLStrategy(
        cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
    )
