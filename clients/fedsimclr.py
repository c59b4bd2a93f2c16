"""FedSimCLR client: SimCLR on all training images (labels unused)."""

from flwr.app import Context, Message

from fedderm.simclr import build_simclr, simclr_round
from records import to_record

from . import finetune
from .common import reply, session


def pretrain(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"], key="simclr", factory=lambda: build_simclr(cfg.model, cfg.image_size))
    images, _ = s.data.tensors("train")
    metrics = simclr_round(model, images, temperature=cfg.option("fedsimclr.temperature"),
                           **s.local_kwargs(server_round, int(config["num-rounds"])))
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, to_record(model.state_dict()))


HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
