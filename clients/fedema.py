"""FedEMA client (Zhuang et al., ICLR 2022 §5; 003 §IV-C4 and 004's FedSSL-R/S baseline): the
FedBYOL client (:mod:`clients.fedbyol`) whose online network is first updated by the
divergence-aware EMA of :mod:`fedderm.fedema` from its own (kept in its state store)."""

from functools import partial

from . import fedbyol, finetune

HANDLERS = {"train.pretrain": partial(fedbyol.pretrain, divergence_aware=True), **finetune.HANDLERS}
