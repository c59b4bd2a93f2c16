"""FedEMA (Zhuang et al., ICLR 2022): on the server it is FedBYOL (FedAvg of the clients' online
networks, then fine-tuning); the divergence-aware EMA runs on the clients (:mod:`clients.fedema`)."""

from .fedbyol import build_strategy, run

__all__ = ["build_strategy", "run"]
