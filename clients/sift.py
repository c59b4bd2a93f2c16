"""SiFT client (paper 002 §2.2–2.3): train the short-term model, then update the long-term one.

A ``train`` message carries the model pair (``short``, ``long``; ``long`` is absent for
``sift.variant="single"``).  The client trains the short-term model's feature extractor with
cross-entropy on the cosine logits of Eq. 1 (P and W frozen unless the variant trains them),
updates θ ← β θ + (1 − β) θ_m (Eq. 2, β = ``sift.ema-beta``; BatchNorm statistics per
``sift.long-bn``) and replies with the pair.
``evaluate`` tests the model it is sent (the long-term model).
"""

from __future__ import annotations

import time

from flwr.app import ArrayRecord, Context, Message

from fedderm.sift import sift_model_from_state, update_long_term
from fedderm.train import evaluate as evaluate_model
from fedderm.train import train_supervised
from wire import to_record, to_state_dict

from .common import reply, session


def _model(s, arrays: ArrayRecord):
    cfg = s.cfg
    model = sift_model_from_state(
        cfg.model,
        to_state_dict(arrays),
        image_size=cfg.image_size,
        temperature=cfg.option("sift.temperature"),
        variant=cfg.option("sift.variant"),
    )
    return model.to(s.device)


def train(msg: Message, context: Context) -> Message:
    started = time.monotonic()
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    short = _model(s, msg.content["short"])
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(
        short, images, labels, augment=s.augment("finetune"), **s.local_kwargs(server_round)
    )
    records = {"short": to_record(short.state_dict())}
    if "long" in msg.content.array_records:
        long_state = update_long_term(
            to_state_dict(msg.content["long"]),
            short,
            float(cfg.option("sift.ema-beta")),
            bn=cfg.option("sift.long-bn"),
            images=images,
            batch_size=cfg.batch_size,
            device=s.device,
        )
        records["long"] = to_record(long_state)
    metrics["partition-id"] = s.partition_id
    metrics["client-seconds"] = time.monotonic() - started
    return reply(msg, metrics, **records)


def evaluate(msg: Message, context: Context) -> Message:
    s = session(context)
    split = str(msg.content["config"].get("split", "val"))
    model = _model(s, msg.content["arrays"])
    images, labels = s.data.tensors(split)
    metrics = evaluate_model(model, images, labels, s.data.num_classes, device=s.device)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics)


HANDLERS = {"train": train, "evaluate": evaluate}
