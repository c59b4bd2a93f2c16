"""Fed-BEiT client: block-wise masking, visual-token prediction on all training images."""

import numpy as np
import torch
from flwr.app import Context, Message

from fedderm.beit import BEiTOptions, beit_loss, build_beit, build_tokenizer
from fedderm.train import random_flips, to_input, train_epochs
from records import to_record

from . import finetune
from .common import reply, session


def pretrain(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    options = BEiTOptions.from_config(cfg)
    model = s.model(msg.content["arrays"], key="beit", factory=lambda: build_beit(cfg))
    tokenizer = s.model(key="tokenizer", factory=lambda: build_tokenizer(cfg))  # same on every client

    def loss_fn(m, xb, yb, generator):
        rng = np.random.default_rng(int(torch.randint(2**31 - 1, (1,), generator=generator)))
        return beit_loss(m, tokenizer, to_input(random_flips(xb, generator), s.device), options.mask_ratio, rng)

    images, labels = s.data.tensors("train")
    metrics = train_epochs(
        model, images, labels, loss_fn, **s.local_kwargs(server_round, int(config["num-rounds"])))
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
