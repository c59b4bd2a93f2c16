"""FedSimCLR client: SimCLR on all training images (labels unused)."""

from fedderm.simclr import build_simclr, simclr_round

from . import finetune


def _simclr_round(s, model, images, labels, **kwargs) -> dict:
    return simclr_round(model, images, temperature=s.cfg.option("fedsimclr.temperature"), **kwargs)


pretrain = finetune.pretrain_handler(
    "simclr", lambda s: build_simclr(s.cfg.model, s.cfg.image_size), _simclr_round
)

HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
