"""Client state that outlives a SuperNode restart: ``context.state`` mirrored under ``state-dir``.

Per-run client state (MoCo's feature bank, MOON's previous model, SCAFFOLD's c_i, FedMAE's kept
parameters, FedBN's BatchNorm layers, ...) lives in ``context.state``, which the SuperNode keeps
in memory for the run.  When the SuperNode was started with node config ``state-dir``, this mod
writes that state to ``<state-dir>/client-state/run-<run id>.pt`` after every message and, when
a restarted SuperNode hands over an empty state for the same run, puts it back first.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord

from wire import to_record, values

KINDS = {"arrays": ArrayRecord, "metrics": MetricRecord, "config": ConfigRecord}


def state_file(context: Context) -> Path | None:
    """Where this node keeps the run's client state, or None without node config ``state-dir``."""
    folder = context.node_config.get("state-dir")
    if not folder:
        return None
    return Path(str(folder)).expanduser() / "client-state" / f"run-{context.run_id}.pt"


def save_state(context: Context, path: Path) -> None:
    """Write every record of ``context.state`` to ``path`` (atomically)."""
    payload = {}
    for name, record in context.state.items():
        if name in context.state.array_records:
            payload[name] = ("arrays", {k: values(a) for k, a in record.items()})
        elif name in context.state.metric_records:
            payload[name] = ("metrics", dict(record))
        else:
            payload[name] = ("config", dict(record))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_state(context: Context, path: Path) -> None:
    """Put the records saved at ``path`` back into ``context.state``."""
    for name, (kind, arrays) in torch.load(path, weights_only=False).items():
        if kind == "arrays":
            context.state[name] = to_record(arrays)
        else:
            context.state[name] = KINDS[kind](arrays)


def persist_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod: restore the run's saved state into an empty ``context.state``, handle
    the message, then save the state again."""
    path = state_file(context)
    if path is not None and not len(context.state) and path.exists():
        load_state(context, path)
    out = call_next(msg, context)
    if path is not None and len(context.state):
        save_state(context, path)
    return out
