"""FedBN (Li et al. 2021; baseline of paper 004): FedAvg over every key except the BatchNorm
ones, which never leave the clients (``clients.fedbn``).  After round 1 the global ArrayRecord
holds only the shared keys, so ``model.pt`` is the shared part; each centre's model is it plus
that centre's own BatchNorm state.  For the final test the server names the round its
best-on-val model comes from (``model-round``) so that each client pairs it with its BN state of
that round."""

from __future__ import annotations

import torch
from flwr.serverapp.strategy import FedAvg

from fedderm.flbt import batchnorm_keys
from fedderm.models import create_model

from .common import Tracked
from .flbt_family import PRCurves, run_strategy


class FedBNStrategy(PRCurves, Tracked, FedAvg):
    """Flower's FedAvg (it averages whatever keys the clients send: the non-BN ones)."""

    _kept: frozenset[str] | None = None

    def kept_keys(self) -> frozenset[str]:
        """The BatchNorm layers' keys (by module type, of ``model`` built on the meta device):
        they stay on the clients, every reply holds every other key sent."""
        if self._kept is None:
            with torch.device("meta"):
                model = create_model(self.cfg.model, 2, self.cfg.image_size)
            self._kept = frozenset(batchnorm_keys(model))
        return self._kept

    def configure_evaluate(self, server_round, arrays, config, grid):
        if str(config.get("split", "val")) in ("test", "global-test") and self.best_round is not None:
            config["model-round"] = int(self.best_round)
        return super().configure_evaluate(server_round, arrays, config, grid)


def build_strategy(cfg, recorder) -> FedBNStrategy:
    n = cfg.min_clients
    return FedBNStrategy(
        cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
    )


def run(grid, cfg, recorder, classes):
    model = create_model(cfg.model, num_classes=len(classes), image_size=cfg.image_size)
    run_strategy(build_strategy(cfg, recorder), grid, cfg, classes, model)
