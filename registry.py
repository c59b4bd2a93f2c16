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
    """

    name: str
    strategy: str
    client: str
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)
    sends: tuple[str, ...] = ("arrays", "metrics")

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
        Method("fedrotation", "strategies.fedrotation", "clients.fedrotation",
               "FedRotation (000 baseline): rotation-prediction pre-training + FedAvg, then fine-tuning."),
        # -- FedMAE, Fed-MAE, Fed-BEiT (issue 4) --
        Method("fedmae", "strategies.fedmae", "clients.fedmae",
               "FedMAE (000 §IV): MAE pre-training, FedAvg over all but fedmae.exclude (kept on the clients, "
               "averaged once after the last round), then fine-tuning. Fed-MAE (003) = exclude none, mask 0.6.",
               options={"fedmae.mask-ratio": 0.75, "fedmae.exclude": "cls-token", "fedmae.norm-pix-loss": False,
                        "fedmae.decoder-embed-dim": 512, "fedmae.decoder-depth": 8,
                        "fedmae.decoder-num-heads": 16, "fedmae.init-checkpoint": "", "fedmae.pretrain": True},
               sends=("arrays", "metrics", "local-arrays")),
        Method("fedbeit", "strategies.fedbeit", "clients.fedbeit",
               "Fed-BEiT (003 §III-C): block-wise masked visual-token prediction + FedAvg, then fine-tuning.",
               options={"fedbeit.mask-ratio": 0.4, "fedbeit.vocab-size": 8192, "fedbeit.tokenizer": ""}),
        # -- SiFT, SCAFFOLD, FedDyn (issue 5) --
        # -- FL-BT, SSL-FL-BT, FedBN, MOON, local (issue 6) --
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
