"""SSL-FL-BT client (paper 004 §III-A): stage 1 (``train.gan``) trains an MSG-GAN on the centre's
own training images and replies with generated pseudo images ONLY (``pseudo-images``, uint8
N×3×S×S) plus scalar metrics -- no real image, no model, no feature leaves the centre.  Stage 2
is FL-BT (``clients.flbt``) from the backbone the server pre-trained on everyone's pseudo images.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, Context, Message

from fedderm.msggan import generate_images, train_msggan

from .common import reply, session
from .flbt import HANDLERS as FLBT_HANDLERS

PSEUDO = "pseudo-images"


def train_gan(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg = s.cfg
    images, _ = s.data.tensors("train")  # the centre's training images; labels are not used
    seed = s.seed(0, salt=7)
    generator, metrics = train_msggan(
        images, steps=int(cfg.option("ssl.gan-steps")), batch_size=int(cfg.option("ssl.gan-batch")),
        latent_dim=int(cfg.option("ssl.gan-latent")), width=int(cfg.option("ssl.gan-width")),
        lr=float(cfg.option("ssl.gan-lr")), seed=seed, device=s.device)
    pseudo = generate_images(generator, int(cfg.option("ssl.pseudo-per-centre")), seed=seed + 1)
    metrics.update({"partition-id": s.partition_id, "num-examples": int(len(pseudo)),
                    "real-images": int(len(images))})
    return reply(msg, metrics, **{PSEUDO: ArrayRecord({PSEUDO: Array(pseudo.numpy())})})


HANDLERS = {"train.gan": train_gan, **FLBT_HANDLERS}
