"""Federated fine-tuning with LoRA adapters (run-config ``peft="lora"``; :mod:`fedderm.lora`).

The fine-tuning stage of the self-supervised plan (:mod:`strategies.finetune`) with a frozen
backbone: the server adds LoRA adapters to the classifier (pre-trained backbone + new head) and

1. sends the frozen backbone once, before round 0, in a ``query.peft_backbone`` message
   (every server start sends it again; a client that holds the same one keeps it);
2. runs the usual rounds (round 0 on val, ``finetune-rounds`` of train + val, test of the
   best-on-val model) on a global model that holds **only the trainable tensors**: the
   adapters and the head (``peft-personal``: only the shared adapter; each hospital keeps
   its personal adapter and the head, and evaluates its own model);
3. saves ``model.pt`` / ``model-best.pt`` with the adapters merged into the backbone (plain
   classifiers for :mod:`fedderm.inference`); with ``peft-personal`` there is no global
   classifier: ``model-shared.pt`` holds the backbone with the shared adapter merged.

``summary.json`` ``peft`` says which tensors were shared, which were kept and what the
one-time backbone transfer weighed; ``bytes_per_round`` counts the rounds' adapter traffic.
"""

from __future__ import annotations

import hashlib
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

import wire
from fedderm.lora import add_lora, count, merged_state, part, split_keys
from fedderm.transport import decode, encode

from .common import Tracked, run_federated
from .nodes import SentTo, send_and_receive, wait_for_nodes
from .screening import short_reason
from .traffic import array_bytes


class PeftFinetune(Tracked, FedAvg):
    """FedAvg over the adapters (and head) only.  Replies must hold exactly the keys sent
    (:meth:`Tracked.validate_reply`), so a personal adapter sent by mistake is refused."""

    personal = False

    def configure_evaluate(self, server_round, arrays, config, grid):
        if self.personal and str(config.get("split", "val")) != "val" and self.best_round is not None:
            config["model-round"] = int(self.best_round)  # each hospital pairs it with its own parts
        return super().configure_evaluate(server_round, arrays, config, grid)


def lora_classifier(cfg, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the run's LoRA adapters (seeded by ``seed``)."""
    return add_lora(
        model,
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        targets=cfg.lora_targets,
        personal=cfg.peft_personal,
        seed=cfg.seed,
    )


def as_sent(state: dict[str, torch.Tensor], transport: str) -> dict[str, torch.Tensor]:
    """``state`` rounded as ``transport-dtype`` rounds it on the way (float16 and back)."""
    return {k: torch.from_numpy(decode(encode(v.numpy(), transport), transport)) for k, v in state.items()}


def digest(record: ArrayRecord) -> str:
    """A fingerprint of ``record``'s keys and bytes (the client checks it holds this backbone)."""
    h = hashlib.sha256()
    for key, array in record.items():
        h.update(key.encode())
        h.update(wire.values(array).tobytes())
    return h.hexdigest()[:32]


def send_backbone(grid: Grid, cfg, frozen: ArrayRecord, personal_init: ArrayRecord | None) -> dict:
    """Send the frozen backbone (and the initial personal tensors) to every connected client;
    returns the transfer's bytes and messages.  Raises when fewer than ``min-clients`` store it."""
    nodes = wait_for_nodes(grid, cfg.min_clients, cfg.round_timeout)
    config = ConfigRecord({"digest": digest(frozen)})
    msgs = []
    for node in nodes:
        content = RecordDict({"arrays": frozen, "config": config})
        if personal_init is not None:
            content[wire.PEFT_PERSONAL_INIT] = personal_init
        msgs.append(Message(content, dst_node_id=node, message_type=wire.PEFT_BACKBONE))
    sent = SentTo(msgs)
    down = sum(array_bytes(m.content, cfg.transport_dtype) for m in msgs)
    replies = send_and_receive(grid, msgs, cfg.round_timeout)
    failed = [f"node {sent.node_of(r)}: {short_reason(r.error.reason)}" for r in replies if r.has_error()]
    stored = len(replies) - len(failed)
    if stored < cfg.min_clients:
        raise RuntimeError(
            f"peft='lora': only {stored} of {len(nodes)} clients stored the frozen backbone "
            f"(min-clients={cfg.min_clients}); {'; '.join(failed) or 'the others did not answer'}"
        )
    return {"bytes": down, "messages": len(msgs), "clients": stored}


def finetune_lora(grid: Grid, cfg, recorder, model: torch.nn.Module) -> None:
    """Stages 2 and 3 with LoRA: ``model`` (pre-trained backbone + head) gets adapters, its frozen
    backbone goes to the clients once, then federated fine-tuning of the trainable part and test."""
    lora = lora_classifier(cfg, model)
    keys = split_keys(lora, cfg.peft_personal)
    if cfg.transport_dtype != "float32":  # the clients hold the backbone as it arrives: so does model.pt
        lora.load_state_dict(as_sent(part(lora, keys["frozen"]), cfg.transport_dtype), strict=False)
    frozen, shared = wire.to_record(part(lora, keys["frozen"])), wire.to_record(part(lora, keys["shared"]))
    own = wire.to_record(part(lora, keys["personal"])) if cfg.peft_personal else None
    total = count(lora.state_dict())
    info = {
        "method": "lora",
        "rank": cfg.lora_rank,
        "alpha": cfg.lora_alpha,
        "dropout": cfg.lora_dropout,
        "targets": sorted(
            {k.split(".lora_")[0][len("backbone.") :] for k in keys["shared"] if ".lora_" in k}
        ),
        "shared": "the shared LoRA adapter" if cfg.peft_personal else "the LoRA adapters and the head",
        "kept-on-clients": "a personal LoRA adapter and the head" if cfg.peft_personal else "nothing",
        "shared-tensors": len(keys["shared"]),
        "shared-parameters": count(lora.state_dict(), keys["shared"]),
        "personal-parameters": count(lora.state_dict(), keys["personal"]),
        "frozen-parameters": count(lora.state_dict(), keys["frozen"]),
        "total-parameters": total,
    }
    log(
        INFO,
        "peft='lora': r=%d, alpha=%g, %d layers; shared %d of %d parameters (%.2f %%), kept on clients %d",
        cfg.lora_rank,
        cfg.lora_alpha,
        len(info["targets"]),
        info["shared-parameters"],
        total,
        100 * info["shared-parameters"] / total,
        info["personal-parameters"],
    )
    transfer = send_backbone(grid, cfg, frozen, own)
    info["backbone-transfer"] = transfer
    recorder.update_extra({"peft": info})
    log(
        INFO,
        "peft='lora': frozen backbone sent once to %d clients (%d bytes)",
        transfer["clients"],
        transfer["bytes"],
    )
    n = cfg.min_clients
    strategy = PeftFinetune(
        cfg=cfg,
        recorder=recorder,
        action="finetune",
        num_rounds=cfg.finetune_rounds,
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
    )
    strategy.personal = cfg.peft_personal
    final = run_federated(strategy, grid, shared)
    best = strategy.best_arrays or final
    if cfg.peft_personal:  # no global classifier: each hospital's head and personal adapter stay there
        lora.load_state_dict(wire.to_state_dict(best), strict=False)
        merged = merged_without(lora, keys["personal"])
        recorder.save_model(
            {k: v for k, v in merged.items() if k.startswith("backbone.")}, name="model-shared.pt"
        )
        for name in ("model.pt", "model-best.pt"):
            (recorder.run_dir / name).unlink(missing_ok=True)
        recorder.update_extra(
            {"peft": {**info, "model-files": "model-shared.pt (backbone + shared adapter)"}}
        )
        return
    for arrays, name in ((final, "model.pt"), (best, "model-best.pt")):
        lora.load_state_dict(wire.to_state_dict(arrays), strict=False)
        recorder.save_model(merged_state(lora), name=name)
    recorder.update_extra({"peft": {**info, "model-files": "model.pt, model-best.pt (adapters merged)"}})


def merged_without(lora: torch.nn.Module, personal_keys: list[str]) -> dict[str, torch.Tensor]:
    """:func:`merged_state` with the personal adapter at zero (only the shared one merged)."""
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name in personal_keys and ".lora_B." in name:
                p.zero_()
    return merged_state(lora)
