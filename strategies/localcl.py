"""Local CL (000 §V baseline): MoCo pre-training on every client alone — no aggregation, no
relay — then the shared fine-tuning stage, each client starting from its *own* pre-trained
backbone (see ``clients/localcl.py``).

The server never sees the pre-trained models: round 1 carries the seeded initial model (every
client starts from the same weights), later rounds carry none, and ``model-pretrained.pt`` in
the run folder is that initial model.
"""

from .fedclf import initial_moco
from .finetune import LocalFinetune, pretrain_strategy, pretrain_then_finetune


class LocalCLStrategy(LocalFinetune):
    """Rounds of local training with nothing averaged (the clients keep their models)."""


def build_strategy(cfg, recorder) -> LocalCLStrategy:
    return pretrain_strategy(LocalCLStrategy, cfg, recorder)


def run(grid, cfg, recorder, classes) -> None:
    pretrain_then_finetune(grid, cfg, recorder, classes, build_strategy(cfg, recorder), initial_moco(cfg))
