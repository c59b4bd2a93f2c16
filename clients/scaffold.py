"""SCAFFOLD client (Karimireddy et al. 2020): local SGD with corrected gradients g − c_i + c.

The client's control variate c_i lives in its state store across rounds; the server's c comes
in the ``control`` record.  The reply carries the trained model (``arrays``) and the change of
c_i (``control-delta``), both for the trainable parameters; BatchNorm buffers are in ``arrays``
only and are averaged plainly by the server.
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.drift import scaffold_train
from wire import to_record, to_state_dict

from .common import reply, session
from .fedavg import evaluate
from .state import client_state

STATE_KEY = "scaffold-c"


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    server_round = int(msg.content["config"]["server-round"])
    model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    c_global = to_state_dict(msg.content["control"]) if "control" in msg.content else {}
    state = client_state(context)
    c_local = state.tensors(STATE_KEY) or {}
    metrics, new_local, delta = scaffold_train(
        model,
        images,
        labels,
        c_global=c_global,
        c_local=c_local,
        augment=s.augment("finetune"),
        **s.local_kwargs(server_round),
    )
    state.put(STATE_KEY, new_local, copy=False)  # fresh tensors: stored as they are
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()), **{"control-delta": to_record(delta)})


HANDLERS = {"train": train, "evaluate": evaluate}
