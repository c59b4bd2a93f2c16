"""Semi-FL client (003 Fig. 10b; :mod:`fedderm.semifl`): cross-entropy on the labelled split, and
from round ``semifl.supervised-rounds`` + 1 on the consistency loss on the client's unlabelled
images (its train split minus the labelled fraction); evaluates like FedAvg."""

from __future__ import annotations

import numpy as np
from flwr.app import Context, Message

from fedderm.semifl import semifl_round
from wire import to_record

from .common import evaluate_split, reply, session


def supervised_rounds(cfg) -> int:
    """``semifl.supervised-rounds``; -1: the first half of ``num-server-rounds`` (003: 400 of 800 epochs)."""
    n = cfg.option("semifl.supervised-rounds")
    return cfg.num_server_rounds // 2 if n < 0 else n


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    split = s.data.split
    unlabelled = s.data.pool.images[np.setdiff1d(split.train, split.labelled)]
    joint = server_round > supervised_rounds(cfg)
    metrics = semifl_round(
        model,
        images,
        labels,
        unlabelled,
        weight=cfg.option("semifl.weight"),
        threshold=cfg.option("semifl.threshold"),
        use_unlabelled=joint,
        augment=s.augment("finetune"),
        **s.local_kwargs(server_round),
    )
    metrics["partition-id"] = s.partition_id
    metrics["unlabelled"] = len(unlabelled) if joint else 0
    return reply(msg, metrics, to_record(model.state_dict()))


def evaluate(msg: Message, context: Context) -> Message:
    split = str(msg.content["config"].get("split", "val"))
    return reply(msg, evaluate_split(session(context), msg.content["arrays"], split))


HANDLERS = {"train": train, "evaluate": evaluate}
