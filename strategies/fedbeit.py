"""Fed-BEiT (003 §III-C): BEiT masked visual-token pre-training averaged by FedAvg (over every
parameter, 003 Alg. 1), then the shared fine-tuning stage from the encoder."""

from logging import INFO

import torch
from flwr.common import log
from flwr.serverapp.strategy import FedAvg

from fedderm.beit import BEiTOptions, build_beit
from wire import to_record

from .common import Tracked
from .fedmae import mae_backbone_state
from .finetune import pretrain_strategy, pretrain_then_finetune


class FedBEiTStrategy(Tracked, FedAvg):
    """FedAvg of the BEiT pre-training models (weighted by the clients' training images)."""


def build_strategy(cfg, recorder) -> FedBEiTStrategy:
    return pretrain_strategy(FedBEiTStrategy, cfg, recorder)


def run(grid, cfg, recorder, classes) -> None:
    options = BEiTOptions.from_config(cfg)
    torch.manual_seed(cfg.seed)
    model = build_beit(cfg)
    log(
        INFO,
        "Fed-BEiT: block-wise mask ratio %.2f, %d visual tokens from %s",
        options.mask_ratio,
        options.vocab_size,
        options.tokenizer or "the seeded random-projection tokenizer (substitute for DALL-E)",
    )
    pretrain_then_finetune(
        grid,
        cfg,
        recorder,
        classes,
        build_strategy(cfg, recorder),
        to_record(model.state_dict()),
        backbone_state=mae_backbone_state(cfg, len(classes)),
    )
