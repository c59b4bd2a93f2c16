"""Client side of the fine-tuning stage shared by every self-supervised method.

``train.finetune`` trains the classifier (pre-trained backbone + new head) on the labelled
split.  Federated: start from the server's weights, reply with them.  Local
(``config["local"]``): start from the server's weights in round 1 and from the client's own
model afterwards, keep the model and its best-on-val copy in ``context.state``, reply with
metrics only.  SSL client modules include :data:`HANDLERS` in theirs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import Context, Message, MetricRecord

from fedderm.metrics import SELECTION_METRIC
from fedderm.train import train_supervised
from wire import to_record

from .common import ClientSession, evaluate_split, reply, session

LOCAL, BEST, BEST_SCORE = "finetune-model", "finetune-best", "finetune-best-score"

#: ``loop(session, model, images, labels, **local_kwargs) -> metrics``: one round of local SSL training
PretrainLoop = Callable[..., dict]


def pretrain_handler(key: str, factory: Callable[[ClientSession], torch.nn.Module],
                     loop: PretrainLoop, mim: bool = False) -> Callable[[Message, Context], Message]:
    """The ``train.pretrain`` handler of an SSL method whose clients train the whole global model:
    load the server's weights into the client's model ``key`` (built once per client session by
    ``factory(session)``), run ``loop`` on all training images (labels unused) with the round's
    local-training settings (with ``mim``: the ``mim.*`` schedule of MAE/BEiT), reply with the
    metrics and the trained weights."""

    def pretrain(msg: Message, context: Context) -> Message:
        s = session(context)
        config = msg.content["config"]
        server_round = int(config["server-round"])
        model = s.model(msg.content["arrays"], key=key, factory=lambda: factory(s))
        images, labels = s.data.tensors("train")
        kwargs = s.mim_kwargs if mim else s.local_kwargs
        metrics = loop(s, model, images, labels, **kwargs(server_round, int(config["num-rounds"])))
        metrics["partition-id"] = s.partition_id
        return reply(msg, metrics, to_record(model.state_dict()))

    return pretrain


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round, local = int(config["server-round"]), bool(config.get("local", False))
    start = context.state[LOCAL] if local and server_round > 1 else msg.content["arrays"]
    model = s.model(start)
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(model, images, labels, **s.local_kwargs(
        server_round, int(config.get("num-rounds", cfg.finetune_rounds)), finetune=True))
    metrics["partition-id"] = s.partition_id
    if local:
        context.state[LOCAL] = to_record(model.state_dict())
        return reply(msg, metrics)
    return reply(msg, metrics, to_record(model.state_dict()))


def evaluate(msg: Message, context: Context) -> Message:
    s = session(context)
    config = msg.content["config"]
    split, local = str(config.get("split", "val")), bool(config.get("local", False))
    if local:
        test = split in ("test", "global-test")
        weights = context.state[BEST] if test and BEST in context.state else context.state[LOCAL]
    else:
        weights = msg.content["arrays"]
    metrics = evaluate_split(s, weights, split)
    score = metrics[SELECTION_METRIC]
    if local and split == "val" and score == score:
        best = context.state[BEST_SCORE]["score"] if BEST_SCORE in context.state else float("-inf")
        if score > best:
            context.state[BEST] = weights
            context.state[BEST_SCORE] = MetricRecord({"score": float(score)})
    return reply(msg, metrics)


HANDLERS = {"train.finetune": train, "evaluate": evaluate}
