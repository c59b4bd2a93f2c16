"""FedDyn client (Acar et al. 2021): local loss L_k(θ) − ⟨h_k, θ⟩ + (α/2)‖θ − θ_global‖².

The client's h_k (its gradient at its previous model) lives in ``context.state`` across rounds;
α is ``feddyn.alpha``.  The reply is the trained model, as for FedAvg.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message

from fedderm.drift import feddyn_train
from fedderm.train import round_lr

from .common import reply, session
from .fedavg import evaluate

STATE_KEY = "feddyn-h"


def train(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"])
    images, labels = s.data.tensors("labelled")
    h_local = context.state[STATE_KEY].to_torch_state_dict() if STATE_KEY in context.state else {}
    metrics, new_h = feddyn_train(
        model, images, labels, h_local=h_local, alpha=float(cfg.option("feddyn.alpha")),
        epochs=cfg.local_epochs, batch_size=cfg.batch_size,
        lr=round_lr(cfg.lr, server_round, cfg.num_server_rounds, cfg.lr_schedule, cfg.lr_decay),
        optimizer=cfg.optimizer, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
        seed=s.seed(server_round), device=s.device)
    context.state[STATE_KEY] = ArrayRecord(new_h)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, ArrayRecord(model.state_dict()))


HANDLERS = {"train": train, "evaluate": evaluate}
