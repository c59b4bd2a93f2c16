"""FedMoCo client: FedCLF's client with feature sharing off (local queue only, nothing uploaded)."""

from functools import partial

from . import fedclf, finetune

HANDLERS = {"train.pretrain": partial(fedclf.pretrain, feature_sharing=False), **finetune.HANDLERS}
