"""FedDyn (Acar et al., ICLR 2021): dynamic regularisation.

Clients add −⟨h_k, θ⟩ + (α/2)‖θ − θ_global‖² to their loss and keep h_k across rounds.  The
server keeps h and sets, for every trainable parameter,
h ← h − α (1/m) Σ_k (θ_k − θ^{t−1}),  θ^t = mean_k θ_k − h/α   (uniform mean, as in the paper);
BatchNorm buffers are averaged as FedAvg does (weighted by ``num-examples``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg

import wire
from fedderm.drift import feddyn_server_step
from fedderm.models import create_model

from .common import Tracked


class FedDynStrategy(Tracked, FedAvg):
    def __init__(self, *, alpha: float, param_names: list[str], **kwargs):
        super().__init__(**kwargs)
        self.alpha, self.param_names = alpha, list(param_names)
        self.own_keys = frozenset(self.param_names)  # θ^t of the parameters is computed below, not averaged
        self.h: dict[str, torch.Tensor] = {}
        self.previous: dict[str, torch.Tensor] | None = None
        self.num_sampled = 0

    def configure_train(self, server_round, arrays, config, grid):
        self.previous = wire.to_state_dict(arrays)  # read-only views: no decoding copies
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        self.num_sampled = len(msgs)
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        arrays, metrics = super().aggregate_train(server_round, replies)
        models = [wire.to_state_dict(r.content["arrays"]) for r in self.accepted]
        if arrays is None or not models:
            return arrays, metrics
        theta, self.h = feddyn_server_step(
            self.previous, models, self.h, self.alpha, max(self.num_sampled, len(models)), self.param_names
        )
        # the buffers' FedAvg mean as it is (the same Arrays), θ^t for the parameters; in the model's order
        order = self.accepted[0].content["arrays"].keys()
        return ArrayRecord({k: wire.to_array(theta[k]) if k in theta else arrays[k] for k in order}), metrics

    def state_dict(self):
        return {**super().state_dict(), "h": dict(self.h)}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.h = dict(state["h"])


def build_strategy(cfg, recorder) -> FedDynStrategy:
    n = cfg.min_clients
    model = create_model(cfg.model, num_classes=2, image_size=cfg.image_size)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return FedDynStrategy(
        cfg=cfg,
        recorder=recorder,
        alpha=float(cfg.option("feddyn.alpha")),
        param_names=names,
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
    )
