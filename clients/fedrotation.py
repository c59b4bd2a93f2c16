"""FedRotation client: rotation prediction on all training images (labels unused)."""

from fedderm.models import create_model
from fedderm.rotation import NUM_ROTATIONS, rotation_loss
from fedderm.train import train_epochs

from . import finetune


def _rotation_round(s, model, images, labels, **kwargs) -> dict:
    augment = s.augment("pretrain")  # 000's policy under augment="paper"
    return train_epochs(
        model, images, labels, lambda m, xb, yb, g: rotation_loss(m, xb, s.device, g, augment), **kwargs
    )


pretrain = finetune.pretrain_handler(
    "rotation", lambda s: create_model(s.cfg.model, NUM_ROTATIONS, s.cfg.image_size), _rotation_round
)

HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
