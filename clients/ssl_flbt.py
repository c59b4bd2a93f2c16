"""SSL-FL-BT client (paper 004 §III-A): stage 1 (``train.gan``) trains an MSG-GAN on the centre's
own training images and replies with generated pseudo images ONLY (``pseudo-images``, uint8
N×3×S×S) plus scalar metrics -- no real image, no model, no feature leaves the centre.  With
``ssl.fid-select`` the centre ranks ``ssl.fid-checkpoints`` generator snapshots by FID to its own
images (on the centre; :mod:`fedderm.fid`) and sends the images of the ``ssl.fid-keep`` best.  Stage 2
is FL-BT (``clients.flbt``) from the backbone the server pre-trained on everyone's pseudo images.
"""

from __future__ import annotations

import hashlib
import time

import torch
from flwr.app import ArrayRecord, Context, Message

from fedderm.fedema import divergence_aware_update
from fedderm.fid import load_feature_extractor, select_pseudo_images
from fedderm.msggan import generate_images, snapshot_steps, train_msggan
from fedderm.simclr import simclr_round
from fedderm.ssl_pseudo import backbone_arrays, encoder_prefix, original_ssl_network, train_multitask
from wire import PSEUDO, to_array, to_record, to_state_dict, values

from . import local
from .common import reply, session
from .flbt import HANDLERS as FLBT_HANDLERS
from .flbt_family import projected
from .state import client_state


def train_gan(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg = s.cfg
    images, _ = s.data.tensors("train")  # the centre's training images; labels are not used
    seed = s.seed(0, salt=7)
    steps, n = int(cfg.option("ssl.gan-steps")), int(cfg.option("ssl.pseudo-per-centre"))
    select = bool(cfg.option("ssl.fid-select"))
    snapshots: list = []
    generator, metrics = train_msggan(
        images,
        steps=steps,
        batch_size=int(cfg.option("ssl.gan-batch")),
        latent_dim=int(cfg.option("ssl.gan-latent")),
        width=int(cfg.option("ssl.gan-width")),
        lr=float(cfg.option("ssl.gan-lr")),
        seed=seed,
        device=s.device,
        snapshot_at=snapshot_steps(steps, int(cfg.option("ssl.fid-checkpoints"))) if select else (),
        snapshots=snapshots,
        augment=s.augment("pretrain"),  # 004 §IV-B: rotations and flips "for all algorithms"
    )
    if select:  # 004 §III-A: keep the generated images with the smallest FID to this centre's images
        start = time.monotonic()
        extractor = load_feature_extractor(str(cfg.option("ssl.fid-features")))
        pseudo, fids = select_pseudo_images(
            generator.cpu(),
            snapshots,
            images,
            n,
            keep=int(cfg.option("ssl.fid-keep")),
            extractor=extractor,
            seed=seed + 1,
        )
        metrics.update(fids)
        metrics["fid_seconds"] = time.monotonic() - start
    else:
        pseudo = generate_images(generator, n, seed=seed + 1)
    metrics.update(
        {"partition-id": s.partition_id, "num-examples": int(len(pseudo)), "real-images": int(len(images))}
    )
    return reply(msg, metrics, **{PSEUDO: ArrayRecord({PSEUDO: to_array(pseudo)})})


# --------------------------------------------------------------- SSL on the original images
OWN_SSL, INITIAL = "ssl-own-model", "ssl-initial-encoder"  # client state (ssl.pretrain="local")
FEDEMA_MODEL, FEDEMA_LAMBDA = "ssl-fedema-model", "ssl-fedema-lambda"  # client state (FedSSL + ssl.fedema)


def ssl_network(cfg) -> torch.nn.Module:
    return original_ssl_network(cfg.model, cfg.image_size, str(cfg.option("ssl.tasks")))


def ssl_prefix(cfg) -> str:
    return encoder_prefix(str(cfg.option("ssl.tasks")))


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        h.update(key.encode())
        h.update(values(arrays[key]).tobytes())
    return h.hexdigest()


def pretrain(msg: Message, context: Context) -> Message:
    """One round of SSL on this centre's original training images (labels unused): restoration
    (patch swap, MSE: SSL-Fed-R / FedSSL-R) or SimCLR (SSL-Fed-S / FedSSL-S), ``ssl.epochs``
    epochs with Adam at ``ssl.lr``.  Federated (FedSSL): start from the server's model, reply with
    it.  Local (SSL-Fed, ``config["local"]``): round 1 starts from the server's initial model,
    later rounds from this centre's own; the model stays here and only metrics are sent."""
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round, alone = int(config["server-round"]), bool(config.get("local", False))
    sent = msg.content.array_records.get("arrays")
    own = client_state(context)
    if alone and INITIAL not in own and sent is not None and len(sent):
        own.put(INITIAL, meta={"digest": digest(backbone_arrays(dict(sent.items()), ssl_prefix(cfg)))})
    if alone and server_round > 1:
        model = s.model(key="ssl", factory=lambda: ssl_network(cfg), state=own.tensors(OWN_SSL))
    else:
        model = s.model(sent, key="ssl", factory=lambda: ssl_network(cfg))
    fedema = not alone and bool(cfg.option("ssl.fedema"))
    ema_metrics = fedema_update(own, model, cfg) if fedema else {}
    images, _ = s.data.tensors("train")
    common = dict(
        epochs=int(cfg.option("ssl.epochs")),
        batch_size=cfg.batch_size,
        lr=float(cfg.option("ssl.lr")),
        optimizer="adam",
        seed=s.seed(server_round, salt=3),
        device=s.device,
    )
    if cfg.option("ssl.tasks") == "simclr":
        metrics = simclr_round(
            model, images, temperature=float(cfg.option("fedsimclr.temperature")), **common
        )
    else:
        metrics = train_multitask(
            model,
            images,
            None,
            patch=int(cfg.option("ssl.swap-patch")),
            swaps=int(cfg.option("ssl.swaps")),
            augment=s.augment("pretrain"),
            **common,
        )
    metrics = {k: v for k, v in metrics.items() if v == v}
    metrics.setdefault("train_loss", metrics.get("ssl_loss", float("nan")))
    metrics["partition-id"] = s.partition_id
    metrics.update(ema_metrics)
    if alone:
        own.put(OWN_SSL, model.state_dict())
        return reply(msg, metrics)
    if fedema:
        own.put(FEDEMA_MODEL, model.state_dict())
    return reply(msg, metrics, to_record(model.state_dict()))


def fedema_update(own, model: torch.nn.Module, cfg) -> dict:
    """FedSSL-R/S on FedEMA (004 [67]; :mod:`fedderm.fedema`): from its second round on, the
    centre's network (loaded with the server's) becomes μ·W_k + (1 − μ)·W_g over its parameters,
    W_k its own network after its previous round (client state), μ = min(λ‖W_g − W_k‖, 1) on the
    encoder (the backbone, and SimCLR's projection head), λ = ``fedema.lambda`` > 0 or the
    autoscaler's τ/‖W_g − W_k‖ (``fedema.tau``) at the first update, kept."""
    kept = own.tensors(FEDEMA_MODEL)
    if kept is None:
        return {}
    simclr = cfg.option("ssl.tasks") == "simclr"
    encoder_prefixes = (ssl_prefix(cfg) + "backbone.", *(("head.",) if simclr else ()))
    params = [n for n, _ in model.named_parameters()]
    encoder = [k for k in params if k.startswith(encoder_prefixes)]
    fixed, saved = cfg.option("fedema.lambda"), own.meta(FEDEMA_LAMBDA)
    lam = fixed if fixed > 0 else (saved["lambda"] if saved is not None else None)
    received = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state, info = divergence_aware_update(kept, received, params, encoder, lam, cfg.option("fedema.tau"))
    if fixed <= 0 and saved is None and info["divergence"] > 0:
        own.put(FEDEMA_LAMBDA, meta={"lambda": info["lambda"]})
    model.load_state_dict(state, strict=True)
    return {f"fedema-{k}": v for k, v in info.items()}


def probe_state(msg: Message, context: Context) -> dict:
    """The encoder a probe scores (``probe-every``): with ``ssl.pretrain="local"`` this centre's own
    pre-trained network (the server only has the initial one), else the model sent."""
    own = (
        client_state(context).tensors(OWN_SSL)
        if session(context).cfg.option("ssl.pretrain") == "local"
        else None
    )
    return dict(own) if own is not None else to_state_dict(msg.content["arrays"])


def with_own_encoder(msg: Message, context: Context) -> Message:
    """SSL-Fed (``ssl.pretrain="local"``): the server never saw the centres' pre-trained models, so the
    004 network it sends carries the initial encoder; swap in this centre's own pre-trained encoder
    wherever that initial encoder arrives (round-0 evaluation, round-1 training, a test of round 0).
    Any other weights (a FedAvg of trained models) are used as sent."""
    state = client_state(context)
    arrays = msg.content.array_records.get("arrays")
    if arrays is None or not len(arrays) or OWN_SSL not in state or INITIAL not in state:
        return msg
    received = backbone_arrays(dict(arrays.items()), "encoder.")
    if digest(received) != state.meta(INITIAL)["digest"]:
        return msg
    own = backbone_arrays(dict(state.tensors(OWN_SSL)), ssl_prefix(session(context).cfg))
    msg.content["arrays"] = ArrayRecord(
        {
            k: to_array(own[k[len("encoder.") :]]) if k[len("encoder.") :] in own else v
            for k, v in arrays.items()
        }
    )
    return msg


def stage2(kind: str):
    """Stage 2's handler for ``kind`` (train | evaluate): FL-BT / FedAvg on the 004 network, or
    each centre alone (``ssl.finetune="local"``: SSL-L-FT), after the own-encoder swap."""

    def handle(msg: Message, context: Context) -> Message:
        s = session(context)
        msg = with_own_encoder(msg, context)
        if s.cfg.option("ssl.finetune") == "local":
            return local.HANDLERS[kind](msg, context, build=projected(s))
        return FLBT_HANDLERS[kind](msg, context)

    return handle


HANDLERS = {
    "train.gan": train_gan,
    "train.pretrain": pretrain,
    "train": stage2("train"),
    "evaluate": stage2("evaluate"),
}
