"""Supervised client for FedAvg and FedProx: train on the labelled split, evaluate on val/test.

The proximal term is on when the server's config carries ``proximal-mu`` > 0 (Flower's FedProx).
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.train import round_lr, train_supervised
from records import to_record

from .common import evaluate_split, reply, session


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(
        model, images, labels, epochs=cfg.local_epochs, batch_size=cfg.batch_size,
        lr=round_lr(cfg.lr, server_round, cfg.num_server_rounds, cfg.lr_schedule, cfg.lr_decay),
        optimizer=cfg.optimizer, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
        proximal_mu=float(config.get("proximal-mu", 0.0)), seed=s.seed(server_round), device=s.device)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))  # ArrayRecord(...)'s bytes, one copy


def evaluate(msg: Message, context: Context) -> Message:
    split = str(msg.content["config"].get("split", "val"))
    return reply(msg, evaluate_split(session(context), msg.content["arrays"], split))


HANDLERS = {"train": train, "evaluate": evaluate}
