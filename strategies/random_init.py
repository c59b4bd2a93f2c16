"""Random init (000 §V baseline): no pre-training; the randomly initialised (seeded) classifier
goes straight to the shared fine-tuning stage (``finetune`` = federated | local) and test.
With ``init-checkpoint`` its backbone starts from that file (supervised fine-tuning of a checkpoint,
with ``peft="lora"`` too)."""

from logging import INFO

import torch
from flwr.common import log

from fedderm.config import ConfigError
from fedderm.lora import load_init_checkpoint
from fedderm.models import create_classifier

from .finetune import FINETUNE_STRATEGIES, finetune_and_test


def build_strategy(cfg, recorder):
    """The fine-tuning strategy (the only stage of this method)."""
    n = cfg.min_clients
    return FINETUNE_STRATEGIES[cfg.finetune](
        cfg=cfg,
        recorder=recorder,
        action="finetune",
        num_rounds=cfg.finetune_rounds,
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
    )


def run(grid, cfg, recorder, classes) -> None:
    if cfg.finetune == "none":
        raise ConfigError("method 'random-init' has no pre-training: set finetune to 'federated' or 'local'")
    torch.manual_seed(cfg.seed)
    model = create_classifier(cfg, len(classes))
    if cfg.init_checkpoint:
        log(INFO, "init-checkpoint: %s", load_init_checkpoint(model, cfg.init_checkpoint))
    finetune_and_test(grid, cfg, recorder, model)
