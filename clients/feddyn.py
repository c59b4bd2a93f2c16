"""FedDyn client (Acar et al. 2021): local loss L_k(θ) − ⟨h_k, θ⟩ + (α/2)‖θ − θ_global‖².

The client's h_k (its gradient at its previous model) lives in ``context.state`` across rounds;
α is ``feddyn.alpha``.  The reply is the trained model, as for FedAvg.
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.drift import feddyn_train
from wire import to_record, to_state_dict

from .common import reply, session
from .fedavg import evaluate

STATE_KEY = "feddyn-h"


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    server_round = int(msg.content["config"]["server-round"])
    model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    h_local = to_state_dict(context.state[STATE_KEY]) if STATE_KEY in context.state else {}
    metrics, new_h = feddyn_train(model, images, labels, h_local=h_local, alpha=float(s.cfg.option("feddyn.alpha")),
                                  **s.local_kwargs(server_round))
    context.state[STATE_KEY] = to_record(new_h)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


HANDLERS = {"train": train, "evaluate": evaluate}
