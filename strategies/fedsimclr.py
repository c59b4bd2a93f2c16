"""FedSimCLR (000 §V baseline): SimCLR pre-training (in-batch negatives) averaged by FedAvg
(weighted by the clients' training images), then the shared fine-tuning stage."""

import torch
from flwr.serverapp.strategy import FedAvg

from fedderm.simclr import build_simclr
from wire import to_record

from .common import Tracked
from .finetune import pretrain_strategy, pretrain_then_finetune


class FedSimCLRStrategy(Tracked, FedAvg):
    """FedAvg of the SimCLR models."""


def build_strategy(cfg, recorder) -> FedSimCLRStrategy:
    return pretrain_strategy(FedSimCLRStrategy, cfg, recorder)


def run(grid, cfg, recorder, classes) -> None:
    torch.manual_seed(cfg.seed)
    model = build_simclr(cfg.model, cfg.image_size)
    pretrain_then_finetune(
        grid, cfg, recorder, classes, build_strategy(cfg, recorder), to_record(model.state_dict())
    )
