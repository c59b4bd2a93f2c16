"""Client side of federated fine-tuning with LoRA adapters (run-config ``peft="lora"``;
:mod:`fedderm.lora`, :mod:`strategies.peft`).

- ``query.peft-backbone``: store the frozen backbone (and, with ``peft-personal``, the initial
  personal adapter and head) in the client state (:func:`clients.state.client_state`), once;
- ``train.finetune``: the frozen backbone from the state, the server's adapters (and head) from
  the message, then local training of the trainable tensors only; the reply holds the shared
  tensors only.  With ``peft-personal`` the personal adapter and head of the latest round come
  from the state, and the trained ones go back there (``peft-personal-r<round>``), never into a reply;
- ``evaluate``: the same model on ``split`` (the personal parts of ``model-round`` for the test).

:mod:`clients.finetune` hands its messages here when ``peft`` is set.
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message

from fedderm.lora import add_lora, load_part, part, split_keys
from fedderm.models import create_classifier
from fedderm.train import evaluate as evaluate_model
from fedderm.train import train_supervised
from wire import PEFT_BACKBONE, PEFT_PERSONAL_INIT, to_record, to_state_dict

from .common import reply, session
from .state import client_state

FROZEN, DIGEST, PERSONAL = "peft-frozen", "peft-frozen-digest", "peft-personal-r"


def build(cfg, num_classes: int) -> torch.nn.Module:
    """The run's classifier with its LoRA adapters (the same structure as the server's)."""
    torch.manual_seed(cfg.seed)
    model = create_classifier(cfg, num_classes)
    return add_lora(
        model,
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        targets=cfg.lora_targets,
        personal=cfg.peft_personal,
        seed=cfg.seed,
    )


def _personal_rounds(context: Context) -> list[int]:
    names = client_state(context).names()
    return sorted(int(n[len(PERSONAL) :]) for n in names if n.startswith(PERSONAL))


def store_backbone(msg: Message, context: Context) -> Message:
    s = session(context)
    state = client_state(context)
    digest = str(msg.content["config"]["digest"])
    meta = state.meta(DIGEST) if DIGEST in state else None
    if meta is None or meta.get("digest") != digest:
        state.put(FROZEN, to_state_dict(msg.content["arrays"]))  # put copies the message's read-only views
        state.put(DIGEST, meta={"digest": digest})
    if PEFT_PERSONAL_INIT in msg.content and not _personal_rounds(context):
        state.put(f"{PERSONAL}0", to_state_dict(msg.content[PEFT_PERSONAL_INIT]))
    return reply(msg, {"partition-id": s.partition_id, "tensors": len(msg.content["arrays"])})


def lora_model(msg: Message, context: Context, personal_round: int):
    """(session, model, key split): the frozen backbone from the state, the message's shared
    tensors and (``peft-personal``) this client's personal tensors of the latest round <=
    ``personal_round``."""
    s = session(context)
    state = client_state(context)
    model = s.model(key="lora", factory=lambda: build(s.cfg, s.data.num_classes))
    keys = split_keys(model, s.cfg.peft_personal)
    if DIGEST not in state:
        raise RuntimeError(
            f"client {s.partition_id}: peft='lora' but no frozen backbone in its client state "
            f"(the server's {PEFT_BACKBONE!r} message did not reach it)"
        )
    digest = state.meta(DIGEST)["digest"]
    if getattr(model, "frozen_digest", None) != digest:  # once per process and backbone
        load_part(model, dict(state.tensors(FROZEN)), keys["frozen"], "the stored frozen backbone")
        model.frozen_digest = digest
    load_part(model, to_state_dict(msg.content["arrays"]), keys["shared"], "the server's adapters")
    if s.cfg.peft_personal:
        rounds = [r for r in _personal_rounds(context) if r <= personal_round]
        if not rounds:
            raise RuntimeError(f"client {s.partition_id}: no personal adapter up to round {personal_round}")
        own = dict(state.tensors(f"{PERSONAL}{rounds[-1]}"))
        load_part(model, own, keys["personal"], "the stored personal adapter")
    return s, model, keys


def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    server_round = int(config["server-round"])
    s, model, keys = lora_model(msg, context, server_round - 1)
    kwargs = s.local_kwargs(server_round, int(config.get("num-rounds", s.cfg.finetune_rounds)), finetune=True)
    torch.manual_seed(kwargs["seed"])  # the LoRA dropout draws from the global generator
    images, labels = s.data.tensors("labelled")
    metrics = train_supervised(model, images, labels, **kwargs, augment=s.augment("finetune"))
    metrics["partition-id"] = s.partition_id
    if s.cfg.peft_personal:
        client_state(context).put(f"{PERSONAL}{server_round}", part(model, keys["personal"]))
    return reply(msg, metrics, to_record(part(model, keys["shared"])))


def evaluate(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    split = str(config.get("split", "val"))
    s, model, _ = lora_model(msg, context, int(config.get("model-round", config["server-round"])))
    images, labels = s.data.tensors(split)
    metrics = evaluate_model(model, images, labels, s.data.num_classes, device=s.device)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics)


HANDLERS = {PEFT_BACKBONE: store_backbone}
