"""FedRotation client: rotation prediction on all training images (labels unused)."""

from flwr.app import Context, Message

from fedderm.models import create_model
from fedderm.rotation import NUM_ROTATIONS, rotation_loss
from fedderm.train import train_epochs
from records import to_record

from . import finetune
from .common import reply, session


def pretrain(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"], key="rotation",
                    factory=lambda: create_model(cfg.model, NUM_ROTATIONS, cfg.image_size))
    images, labels = s.data.tensors("train")
    metrics = train_epochs(
        model, images, labels, lambda m, xb, yb, g: rotation_loss(m, xb, s.device, g),
        **s.local_kwargs(server_round, int(config["num-rounds"])))
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
