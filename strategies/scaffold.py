"""SCAFFOLD (Karimireddy et al., ICML 2020): FedAvg plus control variates.

The server keeps c and sends it with the model (``control`` record); each client keeps its c_i
across rounds (``context.state``) and replies with Δc_i.  The server updates
c ← c + (1/N) Σ Δc_i and sets the model to the *uniform* mean of the clients' models,
x ← x + (1/|S|) Σ Δy_i with global step size 1 (Alg. 1 of Karimireddy et al.; not weighted by
``num-examples``).  Variates cover trainable parameters only; BatchNorm buffers are averaged plainly.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg

import wire
from fedderm.drift import scaffold_server_control

from .common import Tracked

DELTA = "control-delta"


class ScaffoldStrategy(Tracked, FedAvg):
    """Flower's FedAvg carrying the server control variate c to and from the clients; uniform model mean."""

    uniform_mean = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.control = ArrayRecord()  # c = 0 until the first clients report
        self.num_sampled = 0

    def configure_train(self, server_round, arrays, config, grid):
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        for m in msgs:
            m.content["control"] = self.control
        self.num_sampled = len(msgs)
        self.count_traffic(down=self.wire_bytes(self.control) * len(msgs))
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        deltas = {}
        for r in replies:
            if r.has_content() and DELTA in r.content:
                self.count_traffic(up=self.wire_bytes(r.content[DELTA]))
                deltas[id(r)] = wire.to_state_dict(r.content[DELTA])  # views, no copy
                del r.content[DELTA]  # FedAvg wants exactly one ArrayRecord per reply
        result = super().aggregate_train(server_round, replies)
        accepted = [deltas[id(r)] for r in self.accepted if id(r) in deltas]
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
    return ScaffoldStrategy(
        cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
    )
