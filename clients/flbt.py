"""FL-BT client (paper 004 §III-B, Algorithm 1): encoder + projector + output layer; each round
the received global model is kept as a frozen copy in eval mode and the local loss is
CE + μ·L_BT(z_local, z_global).  μ comes from the server (``flbt-mu`` in the train config), so the
same client runs SSL-FL's FedAvg stage (μ = 0: plain cross-entropy, no reference forward).

Also holds what the 004 clients share: local-training arguments and an evaluation reply that adds
the test split's PR curves (``pr-curve``).
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message

from fedderm.flbt import build_projected_net, frozen_copy, train_flbt, train_with_model_term
from fedderm.prcurves import pr_curves
from fedderm.train import evaluate as evaluate_model
from fedderm.train import predict
from records import to_record

from .common import ClientSession, reply, session


def projected(s: ClientSession):
    """Builder of the 004 network on ``cfg.model`` (for ``ClientSession.model``)."""
    return lambda: build_projected_net(s.cfg.model, s.data.num_classes, s.cfg.image_size,
                                       int(s.cfg.option("flbt.proj-dim")))


def evaluation_reply(msg: Message, s: ClientSession, model, split: str) -> Message:
    """Metrics of ``model`` on ``split``; on ``test`` also the PR curves of each class present."""
    images, labels = s.data.tensors(split)
    metrics = evaluate_model(model, images, labels, s.data.num_classes, device=s.device)
    metrics["partition-id"] = s.partition_id
    records = {}
    if split == "test" and len(labels):
        probs = predict(model, images, device=s.device)
        records["pr-curve"] = ConfigRecord(pr_curves(labels.numpy(), probs.numpy(), s.data.num_classes))
    return reply(msg, metrics, **records)


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"], build=projected(s))
    mu = float(config.get("flbt-mu", cfg.option("flbt.mu")))
    images, labels = s.data.tensors("labelled")
    kwargs = s.local_kwargs(server_round)
    if mu > 0:
        metrics = train_flbt(model, frozen_copy(model), images, labels, mu=mu, lambd=float(cfg.option("flbt.lambda")),
                             normalize=str(cfg.option("flbt.normalize")), **kwargs)
    else:
        metrics = train_with_model_term(model, images, labels, term=None, **kwargs)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


def evaluate(msg: Message, context: Context) -> Message:
    s = session(context)
    model = s.model(msg.content["arrays"], build=projected(s))
    return evaluation_reply(msg, s, model, str(msg.content["config"].get("split", "val")))


HANDLERS = {"train": train, "evaluate": evaluate}
