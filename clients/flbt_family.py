"""Client side of the paper-004 family (FL-BT, SSL-FL-BT, FedBN, MOON, local training and the
held-out centre): the 004 network (encoder + projector + output layer, 004 Fig. 4) and an
evaluation reply that adds the test split's per-class PR curves (004 §IV, Fig. 8).
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Message

from fedderm.flbt import build_projected_net
from fedderm.prcurves import pr_curves
from fedderm.train import evaluate as evaluate_model
from fedderm.train import predict
from wire import PR_CURVE

from .common import ClientSession, reply


def projected(s: ClientSession):
    """Builder of the 004 network on ``cfg.model`` (for ``ClientSession.model``)."""
    return lambda: build_projected_net(
        s.cfg.model, s.data.num_classes, s.cfg.image_size, int(s.cfg.option("flbt.proj-dim"))
    )


def evaluation_reply(msg: Message, s: ClientSession, model, split: str) -> Message:
    """Metrics of ``model`` on ``split``; on ``test`` also the PR curves of each class present."""
    images, labels = s.data.tensors(split)
    metrics = evaluate_model(model, images, labels, s.data.num_classes, device=s.device)
    metrics["partition-id"] = s.partition_id
    extra = {}
    if split == "test" and len(labels):
        probs = predict(model, images, device=s.device)
        extra[PR_CURVE] = ConfigRecord(pr_curves(labels.numpy(), probs.numpy(), s.data.num_classes))
    return reply(msg, metrics, **extra)
