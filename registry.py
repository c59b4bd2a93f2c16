"""The one registry: method name -> (server strategy, client handlers, config keys, record keys).

``strategies/<m>.py`` says what the server does, ``clients/<m>.py`` what a client does with a
message; nothing else in the code branches on method names.  Adding a method = one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from fedderm.config import Config, parse_config


@dataclass(frozen=True)
class Method:
    """A method of the product.

    ``strategy``/``client`` are module paths: the strategy module has ``build_strategy(cfg)``,
    the client module a ``HANDLERS`` dict from message type (``train``, ``evaluate``, …) to
    handler.  ``options`` are the method's namespaced run-config keys with their defaults.
    ``sends`` are the record keys its client replies may hold (what the outgoing audit checks).
    ``messages`` are the message types its client handles; types with an action (``train.gan``)
    are registered on the ClientApp from here.
    """

    name: str
    strategy: str
    client: str
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)
    sends: tuple[str, ...] = ("arrays", "metrics")
    messages: tuple[str, ...] = ("train", "evaluate")

    def strategy_module(self) -> ModuleType:
        return importlib.import_module(self.strategy)

    def client_module(self) -> ModuleType:
        return importlib.import_module(self.client)


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("fedavg", "strategies.fedavg", "clients.fedavg",
               "Supervised FedAvg (McMahan et al. 2017), weighted by the clients' labelled images."),
        Method("fedprox", "strategies.fedprox", "clients.fedavg",
               "Supervised FedProx (Li et al. 2020): FedAvg plus the client-side proximal term "
               "(proximal-mu/2)·‖w − w_global‖²."),
        # -- FedCLF and its baselines (issue 3) --
        # -- FedMAE, Fed-MAE, Fed-BEiT (issue 4) --
        # -- SiFT, SCAFFOLD, FedDyn (issue 5) --
        # -- FL-BT, SSL-FL-BT, FedBN, MOON, local (issue 6) --
        Method("flbt", "strategies.flbt", "clients.flbt",
               "FL-BT (paper 004 §III-B): encoder + projector + output layer, local loss "
               "CE + flbt.mu·L_BT(z_local, z_global) against the frozen global model; FedAvg by image count.",
               options={"flbt.mu": 0.01, "flbt.lambda": 0.005, "flbt.normalize": "paper", "flbt.proj-dim": 128},
               sends=("arrays", "metrics", "pr-curve")),
        Method("ssl-flbt", "strategies.ssl_flbt", "clients.ssl_flbt",
               "SSL-FL-BT (paper 004 §III): centres share only MSG-GAN pseudo images; the server pre-trains "
               "the backbone (centre classification + patch-swap restoration); then FL-BT.",
               options={"ssl.pseudo-per-centre": 1000, "ssl.gan-steps": 300, "ssl.gan-batch": 16,
                        "ssl.gan-width": 32, "ssl.gan-latent": 64, "ssl.gan-lr": 0.003, "ssl.tasks": "both",
                        "ssl.finetune": "flbt", "ssl.epochs": 5, "ssl.lr": 0.001, "ssl.swap-patch": 0,
                        "ssl.swaps": 10},
               sends=("arrays", "metrics", "pr-curve", "pseudo-images"),
               messages=("train.gan", "train", "evaluate")),
        Method("fedbn", "strategies.fedbn", "clients.fedbn",
               "FedBN (Li et al. 2021): FedAvg of everything but BatchNorm parameters and running statistics, "
               "which stay on each client.", sends=("arrays", "metrics", "pr-curve")),
        Method("moon", "strategies.moon", "clients.moon",
               "MOON (Li, He & Song 2021): CE + moon.mu·model-contrastive loss (global model positive, "
               "previous local model negative, temperature moon.tau) on the 004 network.",
               options={"moon.mu": 1.0, "moon.tau": 0.5}, sends=("arrays", "metrics", "pr-curve")),
        Method("local", "strategies.local", "clients.local",
               "Single-centre training: every client trains and tests its own model; no aggregation.",
               sends=("metrics", "pr-curve")),
    ]
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}") from None


def method_options() -> dict[str, Any]:
    """Every namespaced key any method declares, with its default."""
    options: dict[str, Any] = {}
    for m in METHODS.values():
        options.update(m.options)
    return options


def load_config(run_config: Mapping[str, Any]) -> Config:
    """Parse ``context.run_config`` against the core keys and every method's options."""
    return parse_config(run_config, methods=METHODS, method_options=method_options())
