"""Fed-BEiT client: block-wise masking, visual-token prediction on all training images."""

import numpy as np
import torch

from fedderm.beit import BEiTOptions, beit_loss, build_beit, build_tokenizer
from fedderm.train import random_flips, to_input, train_epochs

from . import finetune


def _beit_round(s, model, images, labels, **kwargs) -> dict:
    mask_ratio = BEiTOptions.from_config(s.cfg).mask_ratio
    tokenizer = s.model(key="tokenizer", factory=lambda: build_tokenizer(s.cfg))  # same on every client

    def loss_fn(m, xb, yb, generator):
        rng = np.random.default_rng(int(torch.randint(2**31 - 1, (1,), generator=generator)))
        return beit_loss(m, tokenizer, to_input(random_flips(xb, generator), s.device), mask_ratio, rng)

    return train_epochs(model, images, labels, loss_fn, **kwargs)


pretrain = finetune.pretrain_handler("beit", lambda s: build_beit(s.cfg), _beit_round, mim=True)

HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
