"""What every client handler shares: the parsed config, the client's data and model, per process.

A client loads its data once per process (the decoded pool is also cached on disk), so
messages after the first only pay for training.  In deployment a hospital's SuperNode names its
own data with node config (``data-path``, ``dataset``, ``partition-id``, ``site``, ``state-dir``,
``cache-dir``: :mod:`fedderm.node`); in simulation the partition comes from
``partition-id``/``num-partitions``.  Deployed SuperNodes start a new ClientApp process for every
message: state that must outlive one message lives in the client-state store
(:func:`clients.state.client_state`, :mod:`fedderm.state_store`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

import registry
import wire
from fedderm.augment import Augment
from fedderm.augment import policy as augment_policy
from fedderm.config import Config
from fedderm.data import ClientData, DataError, load_client_data
from fedderm.data.checks import class_counts
from fedderm.models import create_classifier
from fedderm.node import NodeSettings, parse_node_config, simulated_node
from fedderm.state_store import fedderm_cache
from fedderm.train import check_precision, mim_schedule, resolve_device, round_lr
from fedderm.train import evaluate as evaluate_model

_SESSIONS: dict[tuple, ClientSession] = {}
#: The default classifier, one per (model, classes, image size) and process: every client session
#: of a simulation worker shares it (it is always loaded with a full state before use), so a
#: worker serving 50 clients holds one ResNet, not 50.
_CLASSIFIERS: dict[tuple, torch.nn.Module] = {}


@dataclass
class ClientSession:
    cfg: Config
    data: ClientData
    device: torch.device
    partition_id: int
    node: NodeSettings
    _models: dict = field(default_factory=dict)

    def model(
        self,
        arrays: ArrayRecord | None = None,
        key: str = "classifier",
        factory: Callable[[], torch.nn.Module] | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> torch.nn.Module:
        """The client's model ``key`` (built once per process by ``factory``;
        default: the classifier ``cfg.model``, shared by the clients of a process: load it with
        ``arrays`` or a full state before use), loaded with ``arrays`` if given, on the client's
        device.  ``state`` (a state dict, e.g. from :func:`clients.state.client_state`) instead of
        ``arrays``."""
        if key not in self._models:
            if factory is None and key == "classifier":
                shared = (
                    self.cfg.model,
                    self.data.num_classes,
                    self.cfg.image_size,
                    self.cfg.vit_pool,
                    str(self.device),
                )
                if shared not in _CLASSIFIERS:
                    _CLASSIFIERS[shared] = create_classifier(self.cfg, self.data.num_classes)
                self._models[key] = _CLASSIFIERS[shared]
            else:
                self._models[key] = (
                    factory or (lambda: create_classifier(self.cfg, self.data.num_classes))
                )()
            if self.cfg.compile and not getattr(self._models[key], "_compiled_call_impl", None):
                self._models[key].compile()  # torch.compile of its forward, once per process (docs/gpu.md)
        model = self._models[key]
        if arrays is not None:  # read-only views of the message's bytes; load_state_dict copies
            model.load_state_dict(wire.to_state_dict(arrays), strict=True)
        elif state is not None:
            model.load_state_dict(state, strict=True)
        return model.to(self.device)

    def augment(self, stage: str) -> Augment:
        """The run's ``augment`` policy for ``stage`` (``pretrain`` | ``finetune``; supervised training
        is ``finetune``), ``paper`` meaning this method's paper (``Method.augment``, ``fedderm/methods/<m>.py``)."""
        return augment_policy(self.cfg.augment, stage, registry.METHODS[self.cfg.method].augment)

    def lr_at(self, base_lr: float, step: int, steps: int) -> float:
        """``base_lr`` at round (or epoch) ``step`` of ``steps`` under the run's ``lr-schedule``
        and ``lr-decay``: the one place every training stage takes its learning rate from."""
        return round_lr(base_lr, step, steps, self.cfg.lr_schedule, self.cfg.lr_decay)

    def local_kwargs(
        self, server_round: int, num_rounds: int | None = None, *, finetune: bool = False
    ) -> dict:
        """The local-training settings for round ``server_round`` of ``num_rounds``, as keyword
        arguments of the local training loops: the spine's (``local-epochs``, ``lr``,
        ``optimizer``; default ``num-server-rounds``) or, with ``finetune``, the fine-tuning
        stage's (``finetune-epochs``, ``finetune-lr``, ``finetune-optimizer``; default
        ``finetune-rounds``).  ``lr`` follows ``lr-schedule``/``lr-decay`` in both."""
        cfg = self.cfg
        batch_size = (cfg.finetune_batch_size or cfg.batch_size) if finetune else cfg.batch_size
        if finetune:
            epochs, base_lr, optimizer, rounds, salt = (
                cfg.finetune_epochs,
                cfg.finetune_lr,
                cfg.finetune_optimizer,
                cfg.finetune_rounds,
                7,
            )
        else:
            epochs, base_lr, optimizer, rounds, salt = (
                cfg.local_epochs,
                cfg.lr,
                cfg.optimizer,
                cfg.num_server_rounds,
                0,
            )
        rounds = rounds if num_rounds is None else num_rounds
        return dict(
            epochs=epochs,
            batch_size=batch_size,
            lr=self.lr_at(base_lr, server_round, rounds),
            optimizer=optimizer,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            seed=self.seed(server_round, salt),
            device=self.device,
        )

    def mim_kwargs(self, server_round: int, num_rounds: int) -> dict:
        """:meth:`local_kwargs` of an MAE/BEiT pre-training round with the ``mim.*`` schedule
        (:func:`fedderm.train.mim_schedule`: warm-up, cosine per iteration, AdamW β2, blr scaling) and
        the pre-training optimiser of ``mim.optimizer`` / ``mim.lr`` / ``mim.weight-decay`` (the core
        ``optimizer`` / ``lr`` / ``weight-decay`` are not read by MAE/BEiT pre-training)."""
        cfg, o = self.cfg, self.cfg.option
        return {
            **self.local_kwargs(server_round, num_rounds),
            "optimizer": o("mim.optimizer"),
            "weight_decay": o("mim.weight-decay"),
            **mim_schedule(
                o("mim.lr"),
                server_round=server_round,
                num_rounds=num_rounds,
                local_epochs=cfg.local_epochs,
                batch_size=cfg.batch_size,
                lr_step=o("mim.lr-step"),
                warmup_epochs=o("mim.warmup-epochs"),
                adam_beta2=o("mim.adam-beta2"),
                lr_scaling=o("mim.lr-scaling"),
                schedule=cfg.lr_schedule,
                decay=cfg.lr_decay,
            ),
        }

    def seed(self, server_round: int, salt: int = 0) -> int:
        """A seed unique to (run seed, round, client): same seed, same numbers."""
        return (self.cfg.seed * 1_000_003 + server_round * 10_007 + self.partition_id * 101 + salt) % 2**31

    def state_path(self, name: str) -> Path:
        """``<state-dir>/<name>`` for client state that must outlive the run (parent created).

        Raises naming the node-config key when the SuperNode was started without ``state-dir``.
        """
        if self.node.state_dir is None:
            raise RuntimeError(
                f"this client needs persistent state ({name!r}) but its SuperNode has no "
                "node-config 'state-dir': start it with --node-config '... state-dir=\"/path\"'"
            )
        path = self.node.state_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


RUN_CONFIG = "run-config"


def session(context: Context) -> ClientSession:
    """This client's session for the current run (config parsed, data loaded: once per process).

    The config is the one the server resolved and handed out with ``query.info`` (kept in
    ``context.state``, which outlives the per-message processes of a deployment), so that
    server and clients always agree, also on a resumed run.
    """
    key = (context.run_id, context.node_id, tuple(sorted(context.node_config.items())))
    if key not in _SESSIONS:
        node = parse_node_config(context.node_config, context.node_id)
        source = context.state[RUN_CONFIG] if RUN_CONFIG in context.state else context.run_config
        cfg = registry.load_config(dict(source))
        # The decoded-image cache is the hospital's business: node-config cache-dir, else
        # <state-dir>/cache, else (a simulation's node) the run config's cache-dir; a hospital's own
        # node with neither key uses its user's cache folder, not the one the server's run config names.
        cache = node.cache_dir or (str(node.state_dir / "cache") if node.state_dir else None)
        if cache is None and not simulated_node(context.node_config):
            cache = str(fedderm_cache() / "cache")
        if cache:
            cfg = dataclasses.replace(cfg, cache_dir=cache)
        try:
            data = load_client_data(
                cfg, node.partition_id, node.num_partitions, data_path=node.data_path, dataset=node.dataset
            )
        except DataError as err:
            if str(err).startswith(f"client {node.partition_id}"):
                raise
            raise DataError(f"client {node.partition_id}: {err}") from err
        torch.manual_seed(cfg.seed)
        device = resolve_device(cfg.device)
        check_precision(cfg.precision, device)
        _SESSIONS[key] = ClientSession(cfg, data, device, node.partition_id, node)
    return _SESSIONS[key]


def forget_sessions() -> None:
    """Drop every client session and shared classifier of this process (their data and models, on
    the GPU too): for in-process benchmarks that run one federation after another."""
    _SESSIONS.clear()
    _CLASSIFIERS.clear()


def reply(msg: Message, metrics: dict, arrays: ArrayRecord | None = None, **extra) -> Message:
    """A reply with ``arrays`` (optional), ``metrics`` (tagged with the partition id) and extras."""
    content = RecordDict({"metrics": MetricRecord(metrics), **extra})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, reply_to=msg)


def info(msg: Message, context: Context) -> Message:
    """``query.info``: take the server's run config; reply with the class list and split sizes,
    so the server can build the model and check that every client maps labels the same way, and
    with the data this client trains on (``dataset``, ``data-path`` as its node config or the run
    config names it, and which of the two: ``data-source``) for the run's record, with what its
    numbers depend on besides the seed: the PyTorch version, intra-op threads and device."""
    if len(msg.content["config"]):
        context.state[RUN_CONFIG] = msg.content["config"]
    s = session(context)
    sp = s.data.split
    own = s.node.data_path is not None or s.node.dataset is not None
    record = ConfigRecord(
        {
            "classes": list(s.data.classes),
            "partition-id": s.partition_id,
            "site": s.node.site,
            "dataset": s.node.dataset or s.cfg.dataset,
            "data-path": s.node.data_path if s.node.data_path is not None else s.cfg.data_path,
            "data-source": "node-config" if own else "run-config",
            "train": len(sp.train),
            "labelled": len(sp.labelled),
            "val": len(sp.val),
            "test": len(sp.test),
            "skipped-files": len(s.data.pool.skipped),
            "torch": torch.__version__,
            "torch-threads": torch.get_num_threads(),
            "device": str(s.device),
            "class-counts": class_counts(
                s.data.pool.labels[np.concatenate([sp.train, sp.val, sp.test])], s.data.num_classes
            ).tolist(),
            **{f"counts-{k}": v for k, v in s.data.class_counts().items()},
        }
    )
    return Message(RecordDict({"info": record}), reply_to=msg)


def evaluate_split(s: ClientSession, weights: ArrayRecord | dict, split: str) -> dict:
    """Metrics of the classifier with ``weights`` (an ArrayRecord or a state dict) on this client's
    ``split`` (tagged with its id)."""
    model = s.model(weights) if isinstance(weights, ArrayRecord) else s.model(state=weights)
    images, labels = s.data.tensors(split)
    metrics = evaluate_model(model, images, labels, s.data.num_classes, device=s.device)
    metrics["partition-id"] = s.partition_id
    return metrics
