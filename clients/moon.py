"""MOON client (Li, He & Song 2021; baseline of paper 004): the 004 network, local loss
CE + μ·ℓ_con with the round's global model as positive and this client's previous local model as
negative.  The previous model lives in the client's state store (``moon-previous``, per client, per run).
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.flbt import frozen_copy, train_moon
from wire import to_record, to_state_dict

from .common import reply, session
from .flbt import evaluate
from .flbt_family import projected
from .state import client_state

PREVIOUS = "moon-previous"


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg = s.cfg
    server_round = int(msg.content["config"]["server-round"])
    model = s.model(msg.content["arrays"], factory=projected(s))
    global_model = frozen_copy(model)  # the round's global model (positive)
    previous = None
    state = client_state(context)
    if PREVIOUS in state:  # this client's model of its previous round (negative)
        previous = frozen_copy(model)  # a copy, not a new network: no random initialisation
        previous.load_state_dict(state.tensors(PREVIOUS), strict=True)
    images, labels = s.data.tensors("labelled")
    metrics = train_moon(
        model,
        global_model,
        previous,
        images,
        labels,
        mu=float(cfg.option("moon.mu")),
        tau=float(cfg.option("moon.tau")),
        augment=s.augment("finetune"),
        **s.local_kwargs(server_round),
    )
    trained = to_record(model.state_dict())
    state.put(PREVIOUS, to_state_dict(trained), copy=False)  # views of the reply's bytes: no copy
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, trained)


HANDLERS = {"train": train, "evaluate": evaluate}
