"""FedRotation (000 §V baseline): rotation-prediction pre-training averaged by FedAvg, then the
shared fine-tuning stage."""

import torch
from flwr.serverapp.strategy import FedAvg

from fedderm.models import create_model
from fedderm.rotation import NUM_ROTATIONS
from wire import to_record

from .common import Tracked
from .finetune import pretrain_strategy, pretrain_then_finetune


class FedRotationStrategy(Tracked, FedAvg):
    """FedAvg of the rotation-prediction models (weighted by the clients' training images)."""


def build_strategy(cfg, recorder) -> FedRotationStrategy:
    return pretrain_strategy(FedRotationStrategy, cfg, recorder)


def run(grid, cfg, recorder, classes) -> None:
    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model, NUM_ROTATIONS, cfg.image_size)
    pretrain_then_finetune(
        grid, cfg, recorder, classes, build_strategy(cfg, recorder), to_record(model.state_dict())
    )
