"""Client side of the fine-tuning stage shared by every self-supervised method.

``train.finetune`` trains the classifier (pre-trained backbone + new head) on the labelled
split.  Federated: start from the server's weights, reply with them.  Local
(``config["local"]``): start from the server's weights in round 1 and from the client's own
model afterwards, keep the model and its best-on-val copy in the client's state store, reply with
metrics only.  SSL client modules include :data:`HANDLERS` in theirs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import Context, Message

from fedderm.metrics import SELECTION_METRIC
from fedderm.train import train_supervised
from wire import to_record

from . import peft
from .common import ClientSession, evaluate_split, reply, session
from .state import client_state

LOCAL, BEST, BEST_SCORE = "finetune-model", "finetune-best", "finetune-best-score"

#: ``loop(session, model, images, labels, **local_kwargs) -> metrics``: one round of local SSL training
PretrainLoop = Callable[..., dict]


def pretrain_handler(
    key: str, factory: Callable[[ClientSession], torch.nn.Module], loop: PretrainLoop, mim: bool = False
) -> Callable[[Message, Context], Message]:
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
    if s.cfg.peft != "none":  # LoRA adapters on the frozen backbone (clients/peft.py)
        return peft.train(msg, context)
    cfg, config = s.cfg, msg.content["config"]
    server_round, local = int(config["server-round"]), bool(config.get("local", False))
    state = client_state(context)
    if local and server_round > 1:
        model = s.model(state=state.tensors(LOCAL))
    else:
        model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(
        model,
        images,
        labels,
        **s.local_kwargs(server_round, int(config.get("num-rounds", cfg.finetune_rounds)), finetune=True),
        augment=s.augment("finetune"),
    )
    metrics["partition-id"] = s.partition_id
    if local:
        state.put(LOCAL, model.state_dict())
        return reply(msg, metrics)
    return reply(msg, metrics, to_record(model.state_dict()))


def evaluate(msg: Message, context: Context) -> Message:
    s = session(context)
    if s.cfg.peft != "none":
        return peft.evaluate(msg, context)
    config = msg.content["config"]
    split, local = str(config.get("split", "val")), bool(config.get("local", False))
    state = client_state(context)
    if local:
        test = split in ("test", "global-test")
        weights = state.tensors(BEST if test and BEST in state else LOCAL)
    else:
        weights = msg.content["arrays"]
    metrics = evaluate_split(s, weights, split)
    score = metrics[SELECTION_METRIC]
    if local and split == "val" and score == score:
        best = state.meta(BEST_SCORE)["score"] if BEST_SCORE in state else float("-inf")
        if score > best:
            state.put(BEST, weights)
            state.put(BEST_SCORE, meta={"score": float(score)})
    return reply(msg, metrics)


HANDLERS = {"train.finetune": train, "evaluate": evaluate}
