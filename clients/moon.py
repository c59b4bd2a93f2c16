"""MOON client (Li, He & Song 2021; baseline of paper 004): the 004 network, local loss
CE + μ·ℓ_con with the round's global model as positive and this client's previous local model as
negative.  The previous model lives in ``context.state["moon-previous"]`` (per client, per run).
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.flbt import frozen_copy, train_moon
from wire import copy_record, to_record, to_state_dict

from .common import reply, session
from .flbt import evaluate
from .flbt_family import projected

PREVIOUS = "moon-previous"


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg = s.cfg
    server_round = int(msg.content["config"]["server-round"])
    model = s.model(msg.content["arrays"], factory=projected(s))
    global_model = frozen_copy(model)  # the round's global model (positive)
    previous = None
    if PREVIOUS in context.state:  # this client's model of its previous round (negative)
        previous = frozen_copy(model)  # a copy, not a new network: no random initialisation
        previous.load_state_dict(to_state_dict(context.state[PREVIOUS]), strict=True)
    images, labels = s.data.tensors("labelled")
    metrics = train_moon(model, global_model, previous, images, labels, mu=float(cfg.option("moon.mu")),
                         tau=float(cfg.option("moon.tau")), **s.local_kwargs(server_round))
    trained = to_record(model.state_dict())
    context.state[PREVIOUS] = copy_record(trained)  # the same immutable Arrays: no second encoding
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, trained)


HANDLERS = {"train": train, "evaluate": evaluate}
