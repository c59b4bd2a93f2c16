"""The plan every self-supervised method shares (SPEC "Shared protocol"; 000 §V-B):

1. ``pretrain``: the method's strategy runs ``num-server-rounds`` rounds of ``train.pretrain``
   on the clients' unlabelled training images;
2. ``finetune``: the pre-trained backbone plus a new linear head is trained on each client's
   labelled fraction, by FedAvg (``finetune="federated"``) or by every client alone
   (``finetune="local"``), for ``finetune-rounds`` rounds of ``finetune-epochs`` epochs;
3. ``test``: the best-on-val model of the fine-tuning stage on every client's test split.

``summary.json`` holds the pre-training rounds (``split="pretrain"``, SSL loss per client) and
the fine-tuning rounds (``split="val"``); ``final`` is the test after fine-tuning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO

import torch
from flwr.app import ArrayRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedderm.models import create_classifier
from wire import to_record, to_state_dict

from . import progress
from .common import Tracked, run_federated, run_rounds
from .probe import probe_due, probe_round


class FederatedFinetune(Tracked, FedAvg):
    """Fine-tuning by FedAvg over the clients' labelled images."""


class LocalFinetune(Tracked, FedAvg):
    """Every client fine-tunes its own copy of the pre-trained model; nothing is averaged.

    Round 1 carries the pre-trained model; later rounds and evaluations carry no weights, and
    each client evaluates (and on the test split, uses its best-on-val) local model.
    """

    def configure_train(self, server_round, arrays, config, grid):
        config["local"] = True
        return super().configure_train(
            server_round, arrays if server_round == 1 else ArrayRecord(), config, grid
        )

    def configure_evaluate(self, server_round, arrays, config, grid):
        config["local"] = server_round > 0  # round 0 evaluates the pre-trained model itself
        return super().configure_evaluate(
            server_round, ArrayRecord() if server_round > 0 else arrays, config, grid
        )

    def weights_problem(self, msg: Message) -> str | None:
        return "a local fine-tuning reply must not carry weights" if "arrays" in msg.content else None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = self.screen(server_round, self._sent_to, list(replies))
        self.train_per_client = self._per_client(replies, server_round)
        return None, None


FINETUNE_STRATEGIES = {"federated": FederatedFinetune, "local": LocalFinetune}


def backbone_prefix_state(
    ssl_state: dict[str, torch.Tensor], prefix: str = "backbone."
) -> dict[str, torch.Tensor]:
    """The default mapping from a pre-trained model to the classifier's backbone: every key
    under ``backbone.`` (the encoder), with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in ssl_state.items() if k.startswith(prefix)}


def classifier_from_pretrained(
    cfg,
    num_classes: int,
    ssl_state: dict[str, torch.Tensor],
    backbone_state: Callable = backbone_prefix_state,
) -> torch.nn.Module:
    """``cfg.model`` with the pre-trained backbone (strict) and a new, seeded linear head."""
    torch.manual_seed(cfg.seed)
    model = create_classifier(cfg, num_classes)
    model.backbone.load_state_dict(backbone_state(ssl_state), strict=True)
    return model


def pretrain_strategy(cls: type[Tracked], cfg, recorder, **kwargs) -> Tracked:
    """``cls`` (a :class:`Tracked` FedAvg) set up for stage 1: every client runs
    ``train.pretrain`` each round, none evaluates (``kwargs`` go to ``cls``)."""
    n = cfg.min_clients
    return cls(
        cfg=cfg,
        recorder=recorder,
        action="pretrain",
        fraction_evaluate=0.0,
        min_train_nodes=n,
        min_available_nodes=n,
        **kwargs,
    )


def pretrain(strategy: Tracked, grid: Grid, initial_arrays: ArrayRecord) -> ArrayRecord:
    """Stage 1: ``strategy.num_rounds`` rounds of ``train.pretrain``; returns the global model."""
    recorder = strategy.recorder

    def on_round(server_round: int, arrays: ArrayRecord) -> None:
        per_client = {
            pid: {"loss": m.get("train_loss", float("nan")), "num-examples": m.get("num-examples", 0)}
            for pid, m in strategy.train_per_client.items()
        }
        mean = recorder.log_round(server_round, "pretrain", per_client)
        left = progress.of(recorder).finish_round(strategy.stage, server_round)
        fields = [("SSL loss", f"{mean.get('loss', float('nan')):.4f}"), ("clients", str(len(per_client)))]
        line = progress.round_line(
            "pretrain", server_round, strategy.num_rounds, fields, strategy.round_seconds, left
        )
        log(INFO, "%s", line)
        if probe_due(strategy.cfg, server_round, strategy.num_rounds):  # probe-every (strategies/probe.py)
            probe_round(grid, strategy.cfg, recorder, server_round, arrays)

    arrays = run_rounds(strategy, grid, initial_arrays, evaluate=False, on_round=on_round)
    recorder.save_model(to_state_dict(arrays), name="model-pretrained.pt")
    return arrays


def pretrain_then_finetune(
    grid: Grid,
    cfg,
    recorder,
    classes: list[str],
    stage1: Tracked,
    initial_arrays: ArrayRecord,
    backbone_state: Callable = backbone_prefix_state,
) -> None:
    """The whole SSL plan: pre-train, then fine-tune (federated or local) and test."""
    log(INFO, "stage 1/2: self-supervised pre-training (%d rounds)", stage1.num_rounds)
    stages = [(stage1.stage, stage1.num_rounds)]
    if cfg.finetune != "none":  # the time left counts the fine-tuning rounds from the start
        stages.append(("finetune", cfg.finetune_rounds))
    progress.of(recorder).plan(stages)
    arrays = pretrain(stage1, grid, initial_arrays)
    finetune_pretrained(grid, cfg, recorder, classes, arrays, backbone_state)


def finetune_pretrained(
    grid: Grid,
    cfg,
    recorder,
    classes: list[str],
    ssl_arrays: ArrayRecord,
    backbone_state: Callable = backbone_prefix_state,
) -> None:
    """Stages 2 and 3 from a pre-trained model: its backbone + a new head, fine-tuned and tested."""
    if cfg.finetune == "none":
        log(INFO, "finetune='none': pre-training only; no fine-tuning or test")
        return
    log(
        INFO,
        "stage 2/2: %s fine-tuning (%d rounds x %d epochs, %.0f %% labels)",
        cfg.finetune,
        cfg.finetune_rounds,
        cfg.finetune_epochs,
        100 * cfg.label_fraction,
    )
    model = classifier_from_pretrained(cfg, len(classes), to_state_dict(ssl_arrays), backbone_state)
    finetune_and_test(grid, cfg, recorder, model)


def finetune_and_test(grid: Grid, cfg, recorder, model: torch.nn.Module) -> None:
    """Stages 2 and 3: fine-tune ``model`` (``finetune`` = federated | local), then test."""
    if cfg.peft != "none":  # LoRA adapters on the frozen backbone (strategies/peft.py)
        from .peft import finetune_lora

        return finetune_lora(grid, cfg, recorder, model)
    n = cfg.min_clients
    strategy = FINETUNE_STRATEGIES[cfg.finetune](
        cfg=cfg,
        recorder=recorder,
        action="finetune",
        num_rounds=cfg.finetune_rounds,
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
    )
    run_federated(strategy, grid, to_record(model.state_dict()))
