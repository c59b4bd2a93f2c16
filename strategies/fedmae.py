"""FedMAE (000 §IV) and Fed-MAE (003 §III): federated MAE pre-training, then the shared fine-tuning.

Knowledge split (000 §IV-D): every round the server averages (FedAvg, weighted by the clients'
training images) every parameter *except* those named by ``fedmae.exclude``; the clients keep
their own copies of the excluded ones across rounds (in ``context.state``) and never send them,
except once: in the last round each client adds them as a second record, ``local-arrays``,
which the server averages with the same weights into the final global model (from the
replies that pass screening only).

Fed-MAE of 003 is this strategy with ``fedmae.exclude="none"`` (plain FedAvg over everything)
and ``fedmae.mask-ratio=0.6`` (``presets/fed-mae-paper.toml``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from logging import INFO

import torch
from flwr.app import ArrayRecord, Message
from flwr.common import log
from flwr.serverapp.strategy import FedAvg

from fedderm.mae import MAEOptions, build_mae, excluded_keys, load_mae_checkpoint, vit_backbone_state
from fedderm.models import create_classifier
from wire import LOCAL_RECORD, to_record

from .common import Tracked
from .finetune import finetune_pretrained, pretrain_strategy, pretrain_then_finetune
from .screening import reply_problem


class FedMAEStrategy(Tracked, FedAvg):
    """FedAvg over the parameters the clients send; the excluded ones (absent from the replies)
    keep their global value during the rounds and become the clients' weighted mean after the
    last round."""

    _global: ArrayRecord | None = None
    #: this round's accepted replies' kept parameters, with their replies and weights
    _local: list[tuple[Message, ArrayRecord, float]] = []
    _kept: frozenset[str] | None = None
    reply_records = Tracked.reply_records | {LOCAL_RECORD}

    def configure_train(self, server_round, arrays, config, grid):
        self._global = arrays
        config["send-local"] = server_round == self.num_rounds
        return super().configure_train(server_round, arrays, config, grid)

    def kept_keys(self) -> frozenset[str]:
        """The parameters ``fedmae.exclude`` keeps on the clients (of the MAE built on the meta
        device: names only, no weights)."""
        if self._kept is None:
            with torch.device("meta"):
                mae = build_mae(self.cfg)
            self._kept = frozenset(excluded_keys(mae, MAEOptions.from_config(self.cfg).exclude))
        return self._kept

    def validate_reply(self, msg: Message) -> str | None:
        """The shared weights as for every strategy, and the kept parameters (``local-arrays``,
        last round only) against the global model's: exactly the kept keys, shape, dtype, finite values."""
        problem = super().validate_reply(msg)
        if problem or LOCAL_RECORD not in msg.content or self._global is None:
            return problem
        local = msg.content.array_records.get(LOCAL_RECORD)
        if local is None:
            return f"{LOCAL_RECORD!r} is not an ArrayRecord"
        kept = ArrayRecord({k: a for k, a in self._global.items() if k in self.kept_keys()})
        problem = reply_problem(local, kept)
        return f"{LOCAL_RECORD}: {problem}" if problem else None

    def _aggregate(self, server_round: int, replies: list[Message]):
        """``replies`` passed screening: only their kept parameters are averaged (the second
        record is taken out first: FedAvg wants exactly one ArrayRecord per reply)."""
        self._local = []
        for msg in replies:
            if LOCAL_RECORD in msg.content:
                record = msg.content.pop(LOCAL_RECORD)
                weight = msg.content["metrics"]["num-examples"]
                self._local.append((msg, record, float(weight)))
        return super()._aggregate(server_round, replies)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._local = []
        arrays, metrics = super().aggregate_train(server_round, replies)
        local = self._local
        if arrays is None:
            return None, metrics
        # weighted by num-examples, as FedAvg weights the synchronised parameters (or the run's robust rule)
        local_mean = (
            self.combine(
                server_round, [m for m, _, _ in local], [r for _, r, _ in local], [w for _, _, w in local]
            )
            if local
            else ArrayRecord()
        )
        if local:
            log(
                INFO,
                "round %d: averaged the clients' %d kept parameters (%s) into the global model",
                server_round,
                len(local_mean),
                ", ".join(local_mean.keys()),
            )
        return merge_global(self._global, arrays, local_mean), metrics


def merge_global(previous: ArrayRecord | None, averaged: ArrayRecord, local_mean: ArrayRecord) -> ArrayRecord:
    """The new global model, in ``previous``'s key order: the averaged synchronised parameters,
    the mean of the clients' kept parameters when they were sent, else the previous value."""
    if previous is None:
        return averaged
    unknown = (set(averaged.keys()) | set(local_mean.keys())) - set(previous.keys())
    if unknown:
        raise ValueError(f"clients sent parameters the global model does not have: {sorted(unknown)[:8]}")
    merged = ArrayRecord()
    for key in previous.keys():
        source = averaged if key in averaged else local_mean if key in local_mean else previous
        merged[key] = source[key]
    return merged


def build_strategy(cfg, recorder) -> FedMAEStrategy:
    return pretrain_strategy(FedMAEStrategy, cfg, recorder)


def mae_backbone_state(cfg, num_classes: int):
    """``backbone_state`` for the shared fine-tuning: the MAE encoder -> ``cfg.model``'s backbone."""
    target = list(create_classifier(cfg, num_classes).backbone.state_dict())
    return partial(vit_backbone_state, target_keys=target)


def run(grid, cfg, recorder, classes) -> None:
    options = MAEOptions.from_config(cfg)
    torch.manual_seed(cfg.seed)
    mae = build_mae(cfg)
    if options.init_checkpoint:
        keys = load_mae_checkpoint(mae, options.init_checkpoint)
        log(
            INFO,
            "fedmae.init-checkpoint: loaded %d tensors from %s (strict)",
            len(keys),
            options.init_checkpoint,
        )
    backbone = mae_backbone_state(cfg, len(classes))
    if not options.pretrain:
        log(
            INFO,
            "fedmae.pretrain=false: no federated pre-training; fine-tuning from %s",
            options.init_checkpoint or "random initialisation",
        )
        finetune_pretrained(grid, cfg, recorder, classes, to_record(mae.state_dict()), backbone)
        return
    log(
        INFO,
        "FedMAE: mask ratio %.2f, kept on the clients: %s, decoder %d wide x %d blocks x %d heads",
        options.mask_ratio,
        options.exclude,
        options.decoder_embed_dim,
        options.decoder_depth,
        options.decoder_num_heads,
    )
    pretrain_then_finetune(
        grid,
        cfg,
        recorder,
        classes,
        build_strategy(cfg, recorder),
        to_record(mae.state_dict()),
        backbone_state=backbone,
    )
