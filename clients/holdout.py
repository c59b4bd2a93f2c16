"""The held-out centre (``holdout-centre``, paper 004 Table XI): it takes no part in the federation
and gets one message, ``train.holdout``, after the method has finished.

The message carries the method's final global model (or no weights: the method has none, so the
centre starts from random weights, Table XI's single-centre "ResNet50" row).  The centre keeps
everything before the output layer, puts a new output layer for its own classes on top (004 §IV-B:
"the output number of the final fully connected layer was changed"), fine-tunes on its labelled
images for ``holdout-epochs`` epochs, picks the best epoch on its validation split and tests it.
It replies with metrics (test metrics, per-epoch validation curve) and the test PR curves only.
"""

from __future__ import annotations

import copy

import torch
from flwr.app import Context, Message

import registry
from fedderm.flbt import batchnorm_keys, build_projected_net
from fedderm.metrics import SELECTION_METRIC
from fedderm.models import create_model
from fedderm.train import evaluate as evaluate_model
from fedderm.train import train_supervised
from wire import to_state_dict

from .common import session
from .flbt_family import evaluation_reply

OUTPUT_LAYER = "head."  # the output layer of the classifier and of the 004 network


def build_network(
    network: str, model: str, num_classes: int, image_size: int, proj_dim: int, vit_pool: str = "avg"
) -> torch.nn.Module:
    """The method's network (registry ``Method.network``) with an output layer for ``num_classes``."""
    if network == "projected":
        return build_projected_net(model, num_classes, image_size, proj_dim)
    if network == "classifier":
        return create_model(model, num_classes=num_classes, image_size=image_size, vit_pool=vit_pool)
    raise ValueError(f"no network {network!r} for a held-out centre")


def transfer(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> list[str]:
    """Load every array of ``weights`` except the output layer into ``model``; returns the keys kept
    from ``model``'s own initialisation.  Only the output layer and BatchNorm state (FedBN's global
    model has none) may be missing; any other difference is an error."""
    own = model.state_dict()
    incoming = {k: v for k, v in weights.items() if not k.startswith(OUTPUT_LAYER)}
    extra = sorted(set(incoming) - set(own))
    if extra:
        raise ValueError(f"the global model has arrays this network lacks: {extra[:3]}")
    missing = sorted(set(own) - set(incoming) - {k for k in own if k.startswith(OUTPUT_LAYER)})
    if set(missing) - batchnorm_keys(model):
        raise ValueError(f"the global model lacks arrays: {sorted(set(missing) - batchnorm_keys(model))[:3]}")
    for key, value in incoming.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(
                f"{key!r} is {tuple(value.shape)} in the global model, {tuple(own[key].shape)} here"
            )
    model.load_state_dict({**own, **incoming}, strict=True)
    return missing


def train_holdout(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg = s.cfg
    network = registry.get_method(cfg.method).network
    torch.manual_seed(s.seed(0, salt=11))
    model = build_network(
        network,
        cfg.model,
        s.data.num_classes,
        cfg.image_size,
        int(cfg.option("flbt.proj-dim")),
        cfg.vit_pool,
    )
    sent = msg.content.array_records.get("arrays")
    kept_own = transfer(model, to_state_dict(sent)) if sent is not None and len(sent) else None
    model = model.to(s.device)
    images, labels = s.data.tensors("labelled")
    val_images, val_labels = s.data.tensors("val")
    curve: dict[str, list[float]] = {"val-balanced_accuracy": [], "val-accuracy": [], "train-loss": []}
    best, best_epoch, best_state = float("-inf"), 0, copy.deepcopy(model.state_dict())
    for epoch in range(1, cfg.holdout_epochs + 1):
        out = train_supervised(
            model,
            images,
            labels,
            epochs=1,
            batch_size=cfg.batch_size,
            lr=s.lr_at(cfg.holdout_lr, epoch, cfg.holdout_epochs),
            optimizer=cfg.optimizer,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            seed=s.seed(epoch, salt=11),
            device=s.device,
        )
        val = evaluate_model(model, val_images, val_labels, s.data.num_classes, device=s.device)
        curve["val-balanced_accuracy"].append(float(val[SELECTION_METRIC]))
        curve["val-accuracy"].append(float(val["accuracy"]))
        curve["train-loss"].append(float(out["train_loss"]))
        if val[SELECTION_METRIC] == val[SELECTION_METRIC] and val[SELECTION_METRIC] > best:
            best, best_epoch, best_state = val[SELECTION_METRIC], epoch, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    out = evaluation_reply(msg, s, model, "test")
    metrics = out.content["metrics"]
    metrics.update(
        {
            "best-epoch": best_epoch,
            "start": 0 if kept_own is None else 1,
            "own-init-arrays": 0 if kept_own is None else len(kept_own),
            **curve,
        }
    )
    return out


HANDLERS = {"train.holdout": train_holdout}
