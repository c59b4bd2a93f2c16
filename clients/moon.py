"""MOON client (Li, He & Song 2021; baseline of paper 004): the 004 network, local loss
CE + μ·ℓ_con with the round's global model as positive and this client's previous local model as
negative.  The previous model lives in ``context.state["moon-previous"]`` (per client, per run).
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.flbt import frozen_copy, train_moon
from records import to_record

from .common import reply, session
from .flbt import evaluate, projected

PREVIOUS = "moon-previous"


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg = s.cfg
    server_round = int(msg.content["config"]["server-round"])
    model = s.model(msg.content["arrays"], build=projected(s))
    previous = None
    if PREVIOUS in context.state:
        previous = projected(s)()
        previous.load_state_dict(context.state[PREVIOUS].to_torch_state_dict(), strict=True)
        previous = frozen_copy(previous)
    images, labels = s.data.tensors("labelled")
    metrics = train_moon(model, frozen_copy(model), previous, images, labels, mu=float(cfg.option("moon.mu")),
                         tau=float(cfg.option("moon.tau")), **s.local_kwargs(server_round))
    context.state[PREVIOUS] = to_record(model.state_dict())
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


HANDLERS = {"train": train, "evaluate": evaluate}
