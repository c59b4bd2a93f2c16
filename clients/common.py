"""What every client handler shares: the parsed config, the client's data and model, per process.

A client loads its data once per process (the decoded pool is also cached on disk), so
messages after the first only pay for training.  In deployment a hospital's SuperNode names its
own data with node config ``data-path`` (and optionally ``dataset``); in simulation the
partition comes from ``partition-id``/``num-partitions``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

import registry
from fedderm.config import Config
from fedderm.data import ClientData, DataError, load_client_data
from fedderm.models import create_model
from fedderm.train import evaluate as evaluate_model
from fedderm.train import resolve_device

_SESSIONS: dict[tuple, "ClientSession"] = {}


@dataclass
class ClientSession:
    cfg: Config
    data: ClientData
    device: torch.device
    partition_id: int
    _models: dict = field(default_factory=dict)

    def model(self, arrays: ArrayRecord | None = None, key: str = "classifier",
              factory: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
        """The client's model ``key`` (built once per process by ``factory``; default: the
        classifier ``cfg.model``), loaded with ``arrays`` if given, on the client's device."""
        if key not in self._models:
            build = factory or (lambda: create_model(self.cfg.model, self.data.num_classes, self.cfg.image_size))
            self._models[key] = build()
        model = self._models[key]
        if arrays is not None:
            model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
        return model.to(self.device)

    def seed(self, server_round: int, salt: int = 0) -> int:
        """A seed unique to (run seed, round, client): same seed, same numbers."""
        return (self.cfg.seed * 1_000_003 + server_round * 10_007 + self.partition_id * 101 + salt) % 2**31


RUN_CONFIG = "run-config"


def session(context: Context) -> ClientSession:
    """This client's session for the current run (config parsed, data loaded: once per process).

    The config is the one the server resolved and handed out with ``query.info`` (kept in
    ``context.state``, which outlives the per-message processes of a deployment), so that
    server and clients always agree, also on a resumed run.
    """
    node = context.node_config
    key = (context.run_id, node.get("partition-id"), node.get("data-path"))
    if key not in _SESSIONS:
        source = context.state[RUN_CONFIG] if RUN_CONFIG in context.state else context.run_config
        cfg = registry.load_config(dict(source))
        pid = int(node.get("partition-id", 0))
        try:
            data = load_client_data(cfg, pid, int(node.get("num-partitions", 1)),
                                    data_path=node.get("data-path"), dataset=node.get("dataset"))
        except DataError as err:
            raise DataError(f"client {pid}: {err}") from err
        torch.manual_seed(cfg.seed)
        _SESSIONS[key] = ClientSession(cfg, data, resolve_device(cfg.device), pid)
    return _SESSIONS[key]


def reply(msg: Message, metrics: dict, arrays: ArrayRecord | None = None, **records) -> Message:
    """A reply with ``arrays`` (optional), ``metrics`` (tagged with the partition id) and extras."""
    content = RecordDict({"metrics": MetricRecord(metrics), **records})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, reply_to=msg)


def info(msg: Message, context: Context) -> Message:
    """``query.info``: take the server's run config; reply with the class list and split sizes,
    so the server can build the model and check that every client maps labels the same way."""
    if len(msg.content["config"]):
        context.state[RUN_CONFIG] = msg.content["config"]
    s = session(context)
    sp = s.data.split
    record = ConfigRecord({"classes": list(s.data.classes), "partition-id": s.partition_id,
                           "train": len(sp.train), "labelled": len(sp.labelled), "val": len(sp.val),
                           "test": len(sp.test), "skipped-files": len(s.data.pool.skipped)})
    return Message(RecordDict({"info": record}), reply_to=msg)


def evaluate_split(s: ClientSession, weights: ArrayRecord, split: str) -> dict:
    """Metrics of the classifier with ``weights`` on this client's ``split`` (tagged with its id)."""
    model = s.model(weights)
    images, labels = s.data.tensors(split)
    metrics = evaluate_model(model, images, labels, s.data.num_classes, device=s.device)
    metrics["partition-id"] = s.partition_id
    return metrics
