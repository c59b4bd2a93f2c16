"""``query.probe``: every client scores the current global encoder with a kNN classifier and a
linear probe on frozen features (run-config ``probe-every``; :mod:`fedderm.probes`).

The message carries the method's pre-training model (``arrays``) and the round; a client module
may define ``probe_state(msg, context) -> state dict`` when the model to probe is not exactly the
one sent (FedMAE puts its kept parameters back; Local CL and SSL-Fed probe their own model).  The
method's ``Method.probe`` mapping turns that state into ``cfg.model``'s backbone; the probes are
trained on the labelled training images and scored on the validation split.  The reply holds only
scalar metrics: ``knn.<metric>``, ``linear.<metric>``, ``num-examples`` (validation images).
"""

from __future__ import annotations

import importlib

from flwr.app import Context, Message

import registry
import wire
from fedderm.models import create_classifier
from fedderm.probes import encode, probe_metrics

from .common import reply, session

PROBES = ("knn", "linear")


def mapping(method_name: str):
    """The method's ``Method.probe`` function (``"module:function"``)."""
    spec = registry.get_method(method_name).probe
    if not spec:
        raise ValueError(f"method {method_name!r} has no encoder to probe")
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def probe(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg = s.cfg
    hook = getattr(importlib.import_module(registry.get_method(cfg.method).client), "probe_state", None)
    state = hook(msg, context) if hook else wire.to_state_dict(msg.content["arrays"])
    model = s.model(key="probe", factory=lambda: create_classifier(cfg, s.data.num_classes))
    model.backbone.load_state_dict(mapping(cfg.method)(cfg, state), strict=True)
    train_x, train_y = s.data.tensors("labelled")
    val_x, val_y = s.data.tensors("val")
    kwargs = dict(batch_size=max(cfg.batch_size, 64), device=s.device)
    results = probe_metrics(
        encode(model, train_x, **kwargs),
        train_y.numpy(),
        encode(model, val_x, **kwargs),
        val_y.numpy(),
        s.data.num_classes,
        seed=cfg.seed,
    )
    metrics = {f"{kind}.{name}": float(value) for kind in PROBES for name, value in results[kind].items()}
    metrics.update(
        {"partition-id": s.partition_id, "num-examples": int(len(val_y)), "labelled": int(len(train_y))}
    )
    return reply(msg, metrics)


HANDLERS = {"query.probe": probe}
