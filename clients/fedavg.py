"""Supervised client for FedAvg and FedProx: train on the labelled split, evaluate on val/test.

The proximal term is on when the server's config carries ``proximal-mu`` > 0 (Flower's FedProx).
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.train import train_supervised
from wire import to_record

from .common import evaluate_split, reply, session


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    config = msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(
        model,
        images,
        labels,
        proximal_mu=float(config.get("proximal-mu", 0.0)),
        augment=s.augment("finetune"),
        **s.local_kwargs(server_round),
    )
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))  # ArrayRecord(...)'s bytes, one copy


def evaluate(msg: Message, context: Context) -> Message:
    split = str(msg.content["config"].get("split", "val"))
    return reply(msg, evaluate_split(session(context), msg.content["arrays"], split))


HANDLERS = {"train": train, "evaluate": evaluate}
