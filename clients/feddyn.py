"""FedDyn client (Acar et al. 2021): local loss L_k(θ) − ⟨h_k, θ⟩ + (α/2)‖θ − θ_global‖².

The client's h_k (its gradient at its previous model) lives in its state store across rounds
(:func:`clients.state.client_state`);
α is ``feddyn.alpha``.  The reply is the trained model, as for FedAvg.
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.drift import feddyn_train
from wire import to_record

from .common import reply, session
from .fedavg import evaluate
from .state import client_state

STATE_KEY = "feddyn-h"


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    server_round = int(msg.content["config"]["server-round"])
    model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    state = client_state(context)
    h_local = state.tensors(STATE_KEY) or {}
    metrics, new_h = feddyn_train(
        model,
        images,
        labels,
        h_local=h_local,
        alpha=float(s.cfg.option("feddyn.alpha")),
        augment=s.augment("finetune"),
        **s.local_kwargs(server_round),
    )
    state.put(STATE_KEY, new_h, copy=False)  # fresh tensors: stored as they are
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


HANDLERS = {"train": train, "evaluate": evaluate}
