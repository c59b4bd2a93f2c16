"""FedMoCo-v3 (003 §IV-C4 baseline): MoCo v3 pre-training of a ViT averaged by FedAvg (weighted by
the clients' training images; the whole model, momentum encoder included, as FedMoCo), then the
shared fine-tuning stage."""

import torch
from flwr.serverapp.strategy import FedAvg

from fedderm.mocov3 import build_mocov3
from wire import to_record

from .common import Tracked
from .finetune import pretrain_strategy, pretrain_then_finetune


class FedMoCoV3Strategy(Tracked, FedAvg):
    """FedAvg of the MoCo v3 models."""


def build_strategy(cfg, recorder) -> FedMoCoV3Strategy:
    return pretrain_strategy(FedMoCoV3Strategy, cfg, recorder)


def initial_model(cfg) -> dict:
    torch.manual_seed(cfg.seed)
    o = cfg.option
    return build_mocov3(cfg.model, cfg.image_size, o("mocov3.hidden-dim"), o("mocov3.proj-dim")).state_dict()


def run(grid, cfg, recorder, classes) -> None:
    pretrain_then_finetune(
        grid, cfg, recorder, classes, build_strategy(cfg, recorder), to_record(initial_model(cfg))
    )
