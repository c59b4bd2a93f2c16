"""FedBYOL (003 §IV-C4 baseline): BYOL pre-training with FedAvg of the online network (backbone,
projector, predictor; weighted by the clients' training images), the target networks staying on
the clients; then the shared fine-tuning stage.  FedEMA (:mod:`strategies.fedema`) averages the
same records."""

import torch
from flwr.serverapp.strategy import FedAvg

from fedderm.byol import build_byol, online_state
from wire import to_record

from .common import Tracked
from .finetune import pretrain_strategy, pretrain_then_finetune


class FedBYOLStrategy(Tracked, FedAvg):
    """FedAvg of the clients' online BYOL networks."""


def build_strategy(cfg, recorder) -> FedBYOLStrategy:
    return pretrain_strategy(FedBYOLStrategy, cfg, recorder)


def initial_online(cfg) -> dict:
    """The seeded initial online network (what round 1 sends)."""
    torch.manual_seed(cfg.seed)
    o = cfg.option
    model = build_byol(cfg.model, cfg.image_size, o("byol.hidden-dim"), o("byol.proj-dim"))
    return online_state(model.state_dict())


def run(grid, cfg, recorder, classes) -> None:
    pretrain_then_finetune(
        grid, cfg, recorder, classes, build_strategy(cfg, recorder), to_record(initial_online(cfg))
    )
