"""FedBN client (Li et al. 2021; baseline of paper 004): every BatchNorm module's parameters and
running statistics stay on the client (chosen by module type, so ResNet's downsample BNs too).

The client uploads only the shared keys.  It keeps its BN state per round in its state store
(``fedbn-bn-r<round>``) and substitutes it into every model it receives -- for training (latest
round) and for evaluation (the round the server's model comes from: ``model-round`` for the final
test of the best-on-val round, else ``server-round``).  Before its first training round a client
uses the BN state it received (the common initial model).
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message

from fedderm.flbt import batchnorm_keys, split_state
from fedderm.train import train_supervised
from wire import to_record, to_state_dict

from .common import reply, session
from .flbt_family import evaluation_reply
from .state import client_state

PREFIX = "fedbn-bn-r"


def _stored_rounds(context: Context) -> list[int]:
    return sorted(int(k[len(PREFIX) :]) for k in client_state(context).names() if k.startswith(PREFIX))


def local_model(msg: Message, context: Context, up_to_round: int) -> torch.nn.Module:
    """The received shared weights with this client's BN state of the latest round <= ``up_to_round``."""
    s = session(context)
    model = s.model()
    state = to_state_dict(msg.content["arrays"])  # read-only views; load_state_dict copies
    bn = batchnorm_keys(model)
    rounds = [r for r in _stored_rounds(context) if r <= up_to_round]
    if rounds:
        state.update(client_state(context).tensors(f"{PREFIX}{rounds[-1]}"))
    elif not bn <= state.keys():
        raise RuntimeError(
            f"fedbn client {s.partition_id}: no local BatchNorm state up to round {up_to_round} "
            "and the server's model carries none"
        )
    model.load_state_dict(state, strict=True)
    return model


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    server_round = int(msg.content["config"]["server-round"])
    model = local_model(msg, context, server_round - 1)
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(
        model, images, labels, augment=s.augment("finetune"), **s.local_kwargs(server_round)
    )
    shared, local = split_state(model.state_dict(), batchnorm_keys(model))
    client_state(context).put(f"{PREFIX}{server_round}", local)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(shared))


def evaluate(msg: Message, context: Context) -> Message:
    s = session(context)
    config = msg.content["config"]
    model_round = int(config.get("model-round", config["server-round"]))
    model = local_model(msg, context, model_round)
    return evaluation_reply(msg, s, model, str(config.get("split", "val")))


HANDLERS = {"train": train, "evaluate": evaluate}
