"""What every client handler shares: the parsed config, the client's data and model, per process.

A client loads its data once per process (the decoded pool is also cached on disk), so
messages after the first only pay for training.  In deployment a hospital's SuperNode names its
own data with node config ``data-path`` (and optionally ``dataset``); in simulation the
partition comes from ``partition-id``/``num-partitions``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

import registry
from fedderm.config import Config
from fedderm.data import ClientData, load_client_data
from fedderm.models import create_model
from fedderm.train import resolve_device

_SESSIONS: dict[tuple, "ClientSession"] = {}


@dataclass
class ClientSession:
    cfg: Config
    data: ClientData
    device: torch.device
    partition_id: int
    _model: torch.nn.Module | None = None

    def model(self, arrays: ArrayRecord | None = None,
              build: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
        """The client's model (built once per process by ``build``, default ``cfg.model``),
        loaded with ``arrays`` if given."""
        if self._model is None:
            self._model = build() if build else create_model(self.cfg.model, self.data.num_classes,
                                                             self.cfg.image_size)
        if arrays is not None:
            self._model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
        return self._model.to(self.device)

    def seed(self, server_round: int, salt: int = 0) -> int:
        """A seed unique to (run seed, round, client): same seed, same numbers."""
        return (self.cfg.seed * 1_000_003 + server_round * 10_007 + self.partition_id * 101 + salt) % 2**31


def session(context: Context) -> ClientSession:
    """This client's session for the current run (config parsed, data loaded: once per process)."""
    node = context.node_config
    key = (context.run_id, node.get("partition-id"), node.get("data-path"))
    if key not in _SESSIONS:
        cfg = registry.load_config(context.run_config)
        pid = int(node.get("partition-id", 0))
        data = load_client_data(cfg, pid, int(node.get("num-partitions", 1)),
                                data_path=node.get("data-path"), dataset=node.get("dataset"))
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
    """``query.info``: class list and split sizes, so the server can build the model and check
    that every client maps labels the same way."""
    s = session(context)
    sp = s.data.split
    record = ConfigRecord({"classes": list(s.data.classes), "partition-id": s.partition_id,
                           "train": len(sp.train), "labelled": len(sp.labelled), "val": len(sp.val),
                           "test": len(sp.test)})
    return Message(RecordDict({"info": record}), reply_to=msg)
