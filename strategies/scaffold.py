"""SCAFFOLD (Karimireddy et al., ICML 2020): FedAvg plus control variates.

The server keeps c and sends it with the model (``control`` record); each client keeps its c_i
across rounds (``context.state``) and replies with Δc_i.  The server updates
c ← c + (1/N) Σ Δc_i and sets the model to the *uniform* mean of the clients' models,
x ← x + (1/|S|) Σ Δy_i with global step size 1 (Alg. 1 of Karimireddy et al.; not weighted by
``num-examples``).  Variates cover trainable parameters only; BatchNorm buffers are averaged plainly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg

import wire
from fedderm.drift import scaffold_server_control
from fedderm.models import create_model

from .common import Tracked
from .screening import reply_problem

DELTA = "control-delta"


class ScaffoldStrategy(Tracked, FedAvg):
    """Flower's FedAvg carrying the server control variate c to and from the clients; uniform model mean."""

    uniform_mean = True
    reply_records = Tracked.reply_records | {DELTA}

    def __init__(self, *, param_names: list[str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.control = ArrayRecord()  # c = 0 until the first clients report
        self.num_sampled = 0
        #: the trainable parameters the variates cover (None: any floating-point key of the model)
        self.param_names = None if param_names is None else list(param_names)
        self._deltas: list[dict] = []

    def configure_train(self, server_round, arrays, config, grid):
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        for m in msgs:
            m.content["control"] = self.control
        self.num_sampled = len(msgs)
        self.count_traffic(down=self.wire_bytes(self.control) * len(msgs))
        return msgs

    def validate_reply(self, msg: Message) -> str | None:
        """The model as for every strategy, and Δc_i (``control-delta``): the trainable parameters'
        keys, their shapes and dtypes, finite values."""
        problem = super().validate_reply(msg)
        if problem or self.sent is None:
            return problem
        delta = msg.content.array_records.get(DELTA)
        if delta is None:
            return f"no {DELTA!r} ArrayRecord"
        if self.param_names is not None:
            names = set(self.param_names)
        else:
            names = {k for k in delta.keys() if k in self.sent and self.sent[k].dtype.startswith("float")}
        problem = reply_problem(delta, ArrayRecord({k: a for k, a in self.sent.items() if k in names}))
        return f"{DELTA}: {problem}" if problem else None

    def _aggregate(self, server_round: int, replies: list[Message]):
        """The screened replies' Δc_i taken out (FedAvg wants exactly one ArrayRecord per reply)."""
        self._deltas = [wire.to_state_dict(r.content.pop(DELTA)) for r in replies if DELTA in r.content]
        return super()._aggregate(server_round, replies)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._deltas = []
        result = super().aggregate_train(server_round, replies)
        accepted = self._deltas
        if accepted and result[0] is not None:  # Δc of rejected or too few replies is not applied
            self.control = wire.to_record(
                scaffold_server_control(
                    wire.to_state_dict(self.control), accepted, max(self.num_sampled, len(accepted))
                )
            )
        return result

    def state_dict(self):
        return {**super().state_dict(), "control": wire.to_state_dict(self.control)}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.control = wire.to_record(state["control"])


def build_strategy(cfg, recorder) -> ScaffoldStrategy:
    n = cfg.min_clients
    with torch.device("meta"):  # the parameter names only
        model = create_model(cfg.model, num_classes=2, image_size=cfg.image_size)
    return ScaffoldStrategy(
        cfg=cfg,
        recorder=recorder,
        param_names=[name for name, p in model.named_parameters() if p.requires_grad],
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
    )
