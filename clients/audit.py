"""Outgoing-message audit: what leaves a hospital, written down by the hospital's own node.

With the environment variable ``FEDDERM_AUDIT_DIR`` set on a SuperNode (or for a simulation),
every reply the ClientApp sends is logged before it leaves: one JSON line per message in
``<dir>/audit-<partition>.jsonl`` (message type, record keys, every array's name, shape, dtype
and SHA-256, every metric and config value, the message's size on the wire), and the arrays
themselves in ``<dir>/<partition>-<n>.npz`` so that an auditor can inspect them.

Sizes are those of Flower's serialised content (protobuf ``ByteSize``): ``sent_bytes`` for the
reply, ``received_bytes`` for the message it answers; the arrays' own bytes per record in
``records.<name>.bytes`` (sent) and ``received_records`` (received).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import Context, Message

from fedderm.flower_private import content_size
from wire import values as wire_values

ENV = "FEDDERM_AUDIT_DIR"


def _describe(msg: Message) -> tuple[dict, dict[str, np.ndarray]]:
    entry, arrays = {"records": {}}, {}
    for name, record in msg.content.items():
        if name in msg.content.array_records:
            desc = {}
            for key, array in record.items():
                values = wire_values(array)
                arrays[f"{name}/{key}"] = values
                desc[key] = {
                    "shape": list(values.shape),
                    "dtype": str(values.dtype),
                    "nbytes": int(values.nbytes),
                    "sha256": hashlib.sha256(values.tobytes()).hexdigest(),
                }
            entry["records"][name] = {
                "type": "arrays",
                "arrays": desc,
                "bytes": sum(int(d["nbytes"]) for d in desc.values()),
            }
        else:
            kind = "metrics" if name in msg.content.metric_records else "config"
            entry["records"][name] = {
                "type": kind,
                "values": {
                    k: (v if not isinstance(v, bytes) else f"<{len(v)} bytes>") for k, v in record.items()
                },
            }
    return entry, arrays


def audit_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod: log every outgoing reply when ``FEDDERM_AUDIT_DIR`` is set."""
    folder = os.environ.get(ENV)
    if not folder:
        return call_next(msg, context)
    # measured before the inner mods and the handler see (and may replace) the incoming content
    received = content_size(msg.content) if msg.has_content() else 0
    received_records = (
        {
            name: sum(wire_values(a).nbytes for a in record.values())
            for name, record in msg.content.array_records.items()
        }
        if msg.has_content()
        else {}
    )
    config = (
        dict(msg.content["config"]) if msg.has_content() and "config" in msg.content.config_records else {}
    )
    out = call_next(msg, context)
    if out.has_error():
        return out
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pid = context.node_config.get("partition-id", context.node_id)
    entry, arrays = _describe(out)
    n = sum(1 for _ in folder.glob(f"{pid}-*.npz"))
    entry.update(
        {
            "time": time.time(),
            "message_type": msg.metadata.message_type,
            "partition-id": pid,
            "server-round": config.get("server-round"),
            "arrays_file": f"{pid}-{n}.npz",
            "sent_bytes": content_size(out.content),
            "received_bytes": received,
            "received_records": received_records,
        }
    )
    np.savez(folder / entry["arrays_file"], **arrays)
    with open(folder / f"audit-{pid}.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry, default=str) + "\n")
    return out
