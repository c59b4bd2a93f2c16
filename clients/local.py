"""Single-centre training (the "ResNet50" row of paper 004 Tables II-IV): each client trains its
own model on its own data; nothing is uploaded but metrics.

The client keeps its model (``local-model``) and its best model on its own validation split
(``local-best-model``, ``local-best``) in its state store; the final test uses that best model.
The server sends the common initial weights once (round-0 evaluation and round-1 training).
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.train import train_supervised

from .common import reply, session
from .flbt_family import evaluation_reply
from .state import client_state

MODEL, BEST_MODEL, BEST = "local-model", "local-best-model", "local-best"
SELECTION_METRIC = "balanced_accuracy"


def own_model(msg: Message, context: Context, key: str = MODEL, build=None):
    """This client's model ``key`` from its state store, else the weights the server sent;
    ``build`` makes the network (default: the classifier ``cfg.model``)."""
    s = session(context)
    own = client_state(context).tensors(key)
    if own is not None:
        return s.model(state=own, factory=build)
    if "arrays" in msg.content and len(msg.content["arrays"]):
        return s.model(msg.content["arrays"], factory=build)
    raise RuntimeError(f"local client {s.partition_id}: no model yet and the server sent none")


def train(msg: Message, context: Context, build=None) -> Message:
    s = session(context)
    server_round = int(msg.content["config"]["server-round"])
    model = own_model(msg, context, build=build)
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(
        model, images, labels, augment=s.augment("finetune"), **s.local_kwargs(server_round)
    )
    client_state(context).put(MODEL, model.state_dict())
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics)


def evaluate(msg: Message, context: Context, build=None) -> Message:
    s = session(context)
    config = msg.content["config"]
    split = str(config.get("split", "val"))
    state = client_state(context)
    if split in ("test", "global-test"):  # the client's own best-on-val model
        model = own_model(msg, context, BEST_MODEL if BEST_MODEL in state else MODEL, build=build)
        out = evaluation_reply(msg, s, model, split)
        out.content["metrics"]["best-round"] = int(state.meta(BEST)["round"]) if BEST in state else 0
        return out
    model = own_model(msg, context, build=build)
    out = evaluation_reply(msg, s, model, split)
    score = float(out.content["metrics"][SELECTION_METRIC])
    best = state.meta(BEST)["score"] if BEST in state else float("-inf")
    if score > best:
        state.put(BEST, meta={"score": score, "round": int(config["server-round"])})
        state.put(BEST_MODEL, model.state_dict())
    return out


HANDLERS = {"train": train, "evaluate": evaluate}
