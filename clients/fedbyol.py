"""FedBYOL client (003 §IV-C4 baseline): BYOL (:mod:`fedderm.byol`) on all training images
(labels unused); receives and sends the online network only.

The target network stays on the client (FedEMA's framework: "aggregate online encoder", the
target kept local): the client's whole BYOL model (online + target) after its round is kept in
its state store (``byol-model``), and the next round starts from the global online network and
the client's own target network.  In its first round a client has no target yet: target ← the
global online backbone and projector.  FedEMA (:mod:`clients.fedema`) uses the same handler with
the divergence-aware update of the online network.
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedderm.byol import BYOL, ONLINE_PREFIXES, build_byol, byol_round, online_state
from fedderm.fedema import ENCODER_PREFIXES, divergence_aware_update
from wire import to_record, to_state_dict

from . import finetune
from .common import ClientSession, reply, session
from .state import client_state

LOCAL_MODEL = "byol-model"  # client state: the whole BYOL model (online + target) after its last round
SCALER = "fedema-lambda"  # client state (FedEMA): the autoscaler's λ of this client


def byol_model(s: ClientSession) -> BYOL:
    o = s.cfg.option
    return s.model(
        key="byol",
        factory=lambda: build_byol(s.cfg.model, s.cfg.image_size, o("byol.hidden-dim"), o("byol.proj-dim")),
    )


def divergence_aware_online(
    state, saved: dict, received: dict, param_keys: list[str], cfg
) -> tuple[dict, dict]:
    """FedEMA §5 (:func:`fedderm.fedema.divergence_aware_update`): the client's online network for
    this round, μ·W_k + (1 − μ)·W_g over the online parameters (encoder and predictor),
    μ = min(λ‖W_g − W_k‖, 1) on the encoder; λ fixed by ``fedema.lambda`` > 0, else the
    autoscaler's, computed once and kept in the client state."""
    fixed, kept = cfg.option("fedema.lambda"), state.meta(SCALER)
    lam = fixed if fixed > 0 else (kept["lambda"] if kept is not None else None)
    encoder = [k for k in param_keys if k.startswith(ENCODER_PREFIXES)]
    online, info = divergence_aware_update(
        saved, received, param_keys, encoder, lam, cfg.option("fedema.tau")
    )
    if fixed <= 0 and kept is None and info["divergence"] > 0:
        state.put(SCALER, meta={"lambda": info["lambda"]})
    return online, {f"fedema-{k}": v for k, v in info.items()}


def pretrain(msg: Message, context: Context, divergence_aware: bool = False) -> Message:
    """``train.pretrain``: one round of local BYOL from the received online network (FedBYOL) or
    its divergence-aware EMA with the client's own (FedEMA)."""
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    state = client_state(context)
    model = byol_model(s)
    received = to_state_dict(msg.content["arrays"])
    saved = state.tensors(LOCAL_MODEL)
    metrics: dict = {}
    if saved is None:  # first participation: online = global, target ← online
        model.load_state_dict({**model.state_dict(), **received}, strict=True)
        model.reset_target()
    else:
        online = received
        if divergence_aware:
            params = [n for n, _ in model.named_parameters() if n.startswith(ONLINE_PREFIXES)]
            online, metrics = divergence_aware_online(state, saved, received, params, cfg)
        model.load_state_dict({**saved, **online}, strict=True)
    images, _ = s.data.tensors("train")
    metrics.update(
        byol_round(
            model,
            images,
            tau=cfg.option("byol.tau"),
            **s.local_kwargs(server_round, int(config["num-rounds"])),
        )
    )
    metrics["partition-id"] = s.partition_id
    weights = model.state_dict()
    state.put(LOCAL_MODEL, weights)
    return reply(msg, metrics, to_record(online_state(weights)))


HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
