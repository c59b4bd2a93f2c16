"""FL-BT client (paper 004 §III-B, Algorithm 1): encoder + projector + output layer; each round
the received global model is kept as a frozen copy in eval mode and the local loss is
CE + μ·L_BT(z_local, z_global).  μ comes from the server (``flbt-mu`` in the train config), so the
same client runs SSL-FL's FedAvg stage (μ = 0: plain cross-entropy, no reference forward).

What the 004 clients share (the 004 network, an evaluation reply with the test split's PR curves)
is in :mod:`clients.flbt_family`.
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.flbt import frozen_copy, train_flbt, train_with_model_term
from wire import to_record

from .common import reply, session
from .flbt_family import evaluation_reply, projected


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"], factory=projected(s))
    mu = float(config.get("flbt-mu", cfg.option("flbt.mu")))
    images, labels = s.data.tensors("labelled")
    kwargs = {**s.local_kwargs(server_round), "augment": s.augment("finetune")}
    if mu > 0:
        metrics = train_flbt(
            model,
            frozen_copy(model),
            images,
            labels,
            mu=mu,
            lambd=float(cfg.option("flbt.lambda")),
            normalize=str(cfg.option("flbt.normalize")),
            **kwargs,
        )
    else:
        metrics = train_with_model_term(model, images, labels, term=None, **kwargs)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


def evaluate(msg: Message, context: Context) -> Message:
    s = session(context)
    model = s.model(msg.content["arrays"], factory=projected(s))
    return evaluation_reply(msg, s, model, str(msg.content["config"].get("split", "val")))


HANDLERS = {"train": train, "evaluate": evaluate}
