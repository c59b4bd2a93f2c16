"""FedSimCLR client: SimCLR on all training images (labels unused)."""

from flwr.app import ArrayRecord, Context, Message

from fedderm.simclr import build_simclr, simclr_round
from fedderm.train import round_lr

from . import finetune
from .common import reply, session


def pretrain(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    model = s.model(msg.content["arrays"], key="simclr", factory=lambda: build_simclr(cfg.model, cfg.image_size))
    images, _ = s.data.tensors("train")
    metrics = simclr_round(
        model, images, temperature=cfg.option("fedsimclr.temperature"), epochs=cfg.local_epochs,
        batch_size=cfg.batch_size, lr=round_lr(cfg.lr, server_round, int(config["num-rounds"]), cfg.lr_schedule),
        optimizer=cfg.optimizer, sgd_momentum=cfg.momentum, weight_decay=cfg.weight_decay,
        seed=s.seed(server_round), device=s.device)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, ArrayRecord(model.state_dict()))


HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
