"""FedCLF client (000 §III, 001 §IV): one round of local MoCo with local and remote negatives;
replies with the model and its local features Q_l.

Messages handled:
- ``query.features`` (before round 1): encode up to K own images with the received model's
  momentum encoder (the initial Q_l) and reply with them, so that round 1 has remote features;
- ``train.pretrain``: :func:`fedderm.moco.moco_round` on all training images (labels unused)
  with the remote features of the instruction's ``remote-features`` record (Q_r, Eq. 2), in
  :func:`fedderm.relay_privacy.canonical_order` (the server's shuffle changes no number);
  replies ``arrays`` (the MoCo model) + ``features`` (Q_l, ``fedclf.feature-dtype``) +
  ``metrics``.  With ``config["local"]`` (Local CL) the model stays on the client
  (its state store) and only metrics are sent.

Client-only state in the client's state store (:func:`clients.state.client_state`), never sent
and never averaged: the local bank Q_l
(``fedclf-local-bank``, oldest feature first, so the FIFO pointer is implied) and, for Local CL,
the client's own model (``fedclf-model``).  The MoCo module has no queue buffers, so
``state_dict()`` — the ``arrays`` that FedAvg averages — holds weights and BatchNorm statistics only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from logging import WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.common import log

from fedderm.config import ConfigError
from fedderm.leakage import audit
from fedderm.moco import FEATURE_DIM, FeatureQueue, MoCo, build_moco, encode_keys, moco_round
from fedderm.node import simulated_node
from fedderm.noise import REPRODUCIBLE
from fedderm.relay_privacy import canonical_order, privatise, releases_per_upload
from wire import FEATURES, REMOTE, to_array, to_record, values

from . import finetune
from .common import ClientSession, reply, session
from .state import client_state

BANK = "fedclf-local-bank"  # client state: Q_l
OWN_MODEL = "fedclf-model"  # client state: Local CL's model
RELAYED = "fedclf-relayed"  # client state (leakage audit only): the last upload and its image ids


@dataclass(frozen=True)
class MocoOptions:
    queue_size: int
    temperature: float
    momentum: float
    feature_sharing: bool
    local_negatives: bool
    feature_dtype: str
    relay_clip: float = 0.0
    relay_noise: float = 0.0
    leakage_audit: bool = False
    leakage_views: int = 0
    leakage_non_members: int = 0

    @classmethod
    def from_config(cls, cfg, feature_sharing: bool | None = None) -> MocoOptions:
        """The ``fedclf.*`` keys; ``feature_sharing`` fixed by FedMoCo / Local CL (False)."""
        return cls(
            queue_size=cfg.option("fedclf.queue-size"),
            temperature=cfg.option("fedclf.temperature"),
            momentum=cfg.option("fedclf.momentum"),
            # "auto" is on wherever the server runs the relay (fedderm.methods.fedclf.feature_sharing)
            feature_sharing=cfg.option("fedclf.feature-sharing") is not False
            if feature_sharing is None
            else feature_sharing,
            local_negatives=cfg.option("fedclf.local-negatives"),
            feature_dtype=cfg.option("fedclf.feature-dtype"),
            relay_clip=cfg.option("fedclf.relay-clip"),
            relay_noise=cfg.option("fedclf.relay-noise-multiplier"),
            leakage_audit=bool(cfg.option("fedclf.leakage-audit")),
            leakage_views=int(cfg.option("fedclf.leakage-views")),
            leakage_non_members=int(cfg.option("fedclf.leakage-non-members")),
        )


def moco_model(s: ClientSession, arrays: ArrayRecord | None) -> MoCo:
    return s.model(arrays, key="moco", factory=lambda: build_moco(s.cfg.model, s.cfg.image_size))


def local_bank(context: Context, s: ClientSession, model: MoCo, queue_size: int) -> FeatureQueue:
    """Q_l from the client's state; the first time, the momentum-encoder features of up to K own
    images (encoded on a copy, so the model's BatchNorm statistics are untouched)."""
    saved = client_state(context).tensors(BANK)
    if saved is not None:
        return FeatureQueue(queue_size, FEATURE_DIM, saved["features"], device=s.device, ids=saved.get("ids"))
    images, _ = s.data.tensors("train")
    keys, ids = encode_keys(
        copy.deepcopy(model),
        images,
        queue_size,
        batch_size=s.cfg.batch_size,
        seed=s.seed(0, salt=11),
        device=s.device,
        with_ids=True,
    )
    return FeatureQueue(queue_size, FEATURE_DIM, keys, device=s.device, ids=ids)


def save_bank(context: Context, bank: FeatureQueue) -> None:
    client_state(context).put(BANK, {"features": bank.ordered(), "ids": bank.ordered_ids()})


def upload(
    bank: FeatureQueue, dtype: str, opts: MocoOptions | None = None, insecure_seed: int | None = None
) -> ArrayRecord:
    """The features this client shares: Q_l in ``fedclf.feature-dtype``; with ``fedclf.relay-clip``
    each vector clipped and noised first (private relay, :mod:`fedderm.relay_privacy`: noise from
    the OS's CSPRNG, or seeded by ``insecure_seed`` under ``insecure-reproducible-noise``)."""
    shared = bank.features().cpu()
    if opts is not None and opts.relay_clip > 0:
        shared = privatise(shared, opts.relay_clip, opts.relay_noise, insecure_seed)
    return ArrayRecord({"features": to_array(np.ascontiguousarray(shared.numpy().astype(dtype)))})


def noise_seed(context: Context, s: ClientSession, server_round: int) -> int | None:
    """The seed of this upload's relay noise: None (the OS's CSPRNG) unless the run config says
    ``insecure-reproducible-noise``.  The server sends the run config, so a coordinating site that
    runs modified code could switch it on and subtract every hospital's noise: the client takes it
    only as a simulated node (:func:`fedderm.node.simulated_node`) or when its own node config says
    ``insecure-reproducible-noise = true``; else it raises naming the key (an error reply: nothing
    drawn, nothing sent).  Taken, it is logged as a warning."""
    if not s.cfg.insecure_reproducible_noise:
        return None
    if not (simulated_node(context.node_config) or s.node.insecure_reproducible_noise):
        raise ConfigError(
            f"run-config key {REPRODUCIBLE!r} is true, but client {s.partition_id} is no simulated node and "
            "its node config does not accept it: its relay noise would be a function of the run config, "
            "which the server knows, so the server could subtract it. This client sends no features. "
            f"It is for simulations only; a hospital that accepts it sets {REPRODUCIBLE}=true in its own "
            "--node-config (docs/privacy.md)"
        )
    if s.cfg.option("fedclf.relay-noise-multiplier") > 0:
        log(
            WARNING,
            "client %d: %s = true: the relay noise of this upload is seeded from seed, round and "
            "partition id; the server can subtract it",
            s.partition_id,
            REPRODUCIBLE,
        )
    return s.seed(server_round, salt=13)


def share(context: Context, bank: FeatureQueue, opts: MocoOptions, insecure_seed: int | None) -> ArrayRecord:
    """:func:`upload`; with ``fedclf.leakage-audit`` the client also keeps (in its state, never
    sent) the uploaded rows and the training-image index of each, for next round's audit."""
    record = upload(bank, opts.feature_dtype, opts, insecure_seed)
    if opts.leakage_audit:
        sent = torch.from_numpy(values(record["features"]).astype(np.float32))
        client_state(context).put(RELAYED, {"features": sent, "ids": bank.image_ids()})
    return record


def leakage_metrics(
    context: Context,
    s: ClientSession,
    model: MoCo,
    remote: torch.Tensor | None,
    server_round: int,
    views: int = 0,
    non_members: int = 0,
) -> dict:
    """``fedclf.leakage-audit`` (:mod:`fedderm.leakage`): the attack an honest-but-curious hospital
    could run this round, against this client.  Relayed features: this client's previous upload
    (relayed to the others this round) among the other clients' (Q_r, what it received itself);
    encoder: the global model just received; members: the training images of the upload's rows;
    non-members: this client's held-out (val and test) images, or with ``non_members`` > 0
    (``fedclf.leakage-non-members``) a seeded sample of that many of them, the same every round.
    ``leakage-auc``, or nothing before the first upload."""
    kept = client_state(context).tensors(RELAYED)
    if kept is None:
        return {}
    ids = torch.unique(kept["ids"][kept["ids"] >= 0])
    train, _ = s.data.tensors("train")
    held_out = torch.cat([s.data.tensors("val")[0], s.data.tensors("test")[0]])
    if len(held_out) == 0:
        raise ValueError(
            f"run-config key 'fedclf.leakage-audit': client {s.partition_id} has no held-out (val or "
            "test) images to serve as the audit's non-members"
        )
    if 0 < non_members < len(held_out):
        pick = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(s.seed(0, salt=19)))
        held_out = held_out[pick[:non_members]]
    relayed = kept["features"] if remote is None else torch.cat([kept["features"], remote])
    auc = audit(
        copy.deepcopy(model),
        train[ids],
        held_out,
        relayed,
        views=views,
        batch_size=s.cfg.batch_size,
        seed=s.seed(server_round, salt=17),
        device=s.device,
    )
    return {"leakage-auc": auc, "leakage-members": len(ids), "leakage-non-members": len(held_out)}


def relay_metrics(s: ClientSession, opts: MocoOptions) -> dict:
    """``relay-releases``: the most times one training image is in this upload (privacy accounting)."""
    if opts.relay_clip <= 0:
        return {}
    return {"relay-releases": releases_per_upload(opts.queue_size, len(s.data.split.train))}


def features(msg: Message, context: Context, feature_sharing: bool | None = None) -> Message:
    """``query.features``: the initial Q_l, encoded by the server's model."""
    s = session(context)
    opts = MocoOptions.from_config(s.cfg, feature_sharing)
    seed = noise_seed(context, s, 0)
    bank = local_bank(context, s, moco_model(s, msg.content["arrays"]), opts.queue_size)
    save_bank(context, bank)
    return reply(
        msg,
        {"partition-id": s.partition_id, "num-examples": len(bank), **relay_metrics(s, opts)},
        **{FEATURES: share(context, bank, opts, seed)},
    )


def pretrain(msg: Message, context: Context, feature_sharing: bool | None = None) -> Message:
    """``train.pretrain``: one round of local contrastive learning (Eq. 3–6)."""
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    opts = MocoOptions.from_config(cfg, feature_sharing)
    server_round, local = int(config["server-round"]), bool(config.get("local", False))
    seed = noise_seed(context, s, server_round) if opts.feature_sharing and not local else None
    state = client_state(context)
    if local and server_round > 1:
        model = s.model(
            key="moco",
            factory=lambda: build_moco(s.cfg.model, s.cfg.image_size),
            state=state.tensors(OWN_MODEL),
        )
    else:
        model = moco_model(s, msg.content["arrays"])
    bank = local_bank(context, s, model, opts.queue_size)
    remote = None
    if opts.feature_sharing and REMOTE in msg.content:
        remote = torch.from_numpy(canonical_order(values(msg.content[REMOTE]["features"])).astype(np.float32))
    audited = (
        leakage_metrics(context, s, model, remote, server_round, opts.leakage_views, opts.leakage_non_members)
        if opts.leakage_audit and opts.feature_sharing and not local
        else {}
    )
    images, _ = s.data.tensors("train")
    metrics = moco_round(
        model,
        images,
        bank,
        remote=remote,
        feature_sharing=opts.feature_sharing,
        local_negatives=opts.local_negatives,
        queue_size=opts.queue_size,
        temperature=opts.temperature,
        key_momentum=opts.momentum,
        **s.local_kwargs(server_round, int(config["num-rounds"])),
    )
    metrics["partition-id"] = s.partition_id
    metrics["remote-features"] = 0 if remote is None else len(remote)
    metrics.update(audited)
    save_bank(context, bank)
    if local:
        state.put(OWN_MODEL, model.state_dict())
        return reply(msg, metrics)
    weights = to_record(model.state_dict())
    extra = {FEATURES: share(context, bank, opts, seed)} if opts.feature_sharing else {}
    if opts.feature_sharing:
        metrics.update(relay_metrics(s, opts))
    return reply(msg, metrics, weights, **extra)


HANDLERS = {"query.features": features, "train.pretrain": pretrain, **finetune.HANDLERS}
