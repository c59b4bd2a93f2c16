"""fedderm's ClientApp with a timing mod, for the overhead and scale benchmarks.

With ``FEDDERM_BENCH_TRACE=<dir>`` set, every message a client handles appends one JSON line to
``<dir>/<pid>.jsonl``: message type, partition, handler start and end (``time.time()``), and
``work``: seconds spent inside the local loops themselves (``fedderm.train.train_epochs`` and the
evaluation of ``clients.common.evaluate_model``), the part a plain PyTorch loop also pays.
"""

from __future__ import annotations

import json
import os
import time

from flwr.clientapp import ClientApp

import client_app as real
from clients.audit import audit_mod
from clients.persist import persist_mod

_WORK = [0.0]
_PATCHED = [False]


def _timed(fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _WORK[0] += time.perf_counter() - t
    wrapper.__wrapped__ = fn
    return wrapper


def _patch() -> None:
    """Time the local loops (done once per process, at its first message)."""
    import clients.common
    import fedderm.train

    fedderm.train.train_epochs = _timed(fedderm.train.train_epochs)
    clients.common.evaluate_model = _timed(clients.common.evaluate_model)
    _PATCHED[0] = True


def timing_mod(msg, context, call_next):
    folder = os.environ.get("FEDDERM_BENCH_TRACE")
    if not folder:
        return call_next(msg, context)
    if not _PATCHED[0]:
        _patch()
    _WORK[0] = 0.0
    t0 = time.time()
    out = call_next(msg, context)
    t1 = time.time()
    entry = {"type": msg.metadata.message_type, "pid": os.getpid(),
             "partition": context.node_config.get("partition-id"), "t0": t0, "t1": t1, "work": _WORK[0],
             "threads": __import__("torch").get_num_threads()}
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")
    return out


app = real.register(ClientApp(mods=[persist_mod, audit_mod, timing_mod]))


def read_trace(folder) -> list[dict]:
    """Every entry written under ``folder``, in start order."""
    entries = []
    for name in os.listdir(folder):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                entries += [json.loads(line) for line in fh if line.strip()]
    return sorted(entries, key=lambda e: e["t0"])
