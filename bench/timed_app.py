"""fedderm's ClientApp with a timing mod, for the overhead, scale and per-method benchmarks.

With ``FEDDERM_BENCH_TRACE=<dir>`` set, every message a client handles appends one JSON line to
``<dir>/<pid>.jsonl``: message type, partition, handler start and end (``time.time()``), ``work``:
seconds spent inside the local loops themselves (:data:`LOOPS`: the training loops of every
method, the GAN, the evaluation pass, SiFT's BatchNorm recompute), the part a plain PyTorch loop
also pays, and ``spans``: those loops' (start, end) intervals.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

from flwr.clientapp import ClientApp

import client_app as real
import registry
from clients.audit import audit_mod
from clients.state import state_mod

#: The local loops, as (module, function): the work a plain PyTorch loop would do too.
LOOPS = [
    ("fedderm.train", "train_epochs"),
    ("fedderm.train", "evaluate"),
    ("fedderm.flbt", "train_with_model_term"),
    ("fedderm.ssl_pseudo", "train_multitask"),
    ("fedderm.msggan", "train_msggan"),
    ("fedderm.sift", "update_long_term"),
]

_WORK = [0.0]
_SPANS: list[list[float]] = []
_DEPTH = [0]
_WRAPPERS: dict[int, object] = {}  # id(loop function) -> its timed wrapper


def _timed(fn):
    def wrapper(*args, **kwargs):
        _DEPTH[0] += 1
        t, wall = time.perf_counter(), time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:  # a loop called inside another (train_supervised -> train_epochs) counts once
                _WORK[0] += time.perf_counter() - t
                _SPANS.append([wall, time.time()])

    wrapper.__wrapped__ = fn
    return wrapper


def _patch(method: str | None) -> None:
    """Time the local loops: every reference to a loop function in fedderm's own modules
    (``from fedderm.train import train_epochs`` binds a name of its own) is replaced by its timed
    wrapper.  Run before every message, with the run's ``method`` module imported first (the
    ClientApp imports it at its first train message)."""
    if method in registry.METHODS:
        importlib.import_module(registry.get_method(method).client)
    if not _WRAPPERS:
        for module, name in LOOPS:
            fn = getattr(importlib.import_module(module), name)
            _WRAPPERS[id(fn)] = _timed(fn)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.split(".")[0] not in ("fedderm", "clients", "client_app"):
            continue
        for attr, value in list(vars(mod).items()):
            if callable(value) and id(value) in _WRAPPERS:
                setattr(mod, attr, _WRAPPERS[id(value)])


def _gpu_peak() -> int:
    """Peak CUDA memory this client process has allocated (0 without CUDA work)."""
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0


def timing_mod(msg, context, call_next):
    folder = os.environ.get("FEDDERM_BENCH_TRACE")
    if not folder:
        return call_next(msg, context)
    _patch(context.run_config.get("method"))
    _WORK[0] = 0.0
    _SPANS.clear()
    t0 = time.time()
    out = call_next(msg, context)
    t1 = time.time()
    entry = {
        "type": msg.metadata.message_type,
        "pid": os.getpid(),
        "partition": context.node_config.get("partition-id"),
        "t0": t0,
        "t1": t1,
        "work": _WORK[0],
        "spans": list(_SPANS),
        "threads": __import__("torch").get_num_threads(),
        "gpu_peak": _gpu_peak(),
    }
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")
    return out


app = real.register(ClientApp(mods=[state_mod, audit_mod, timing_mod]))


def read_trace(folder) -> list[dict]:
    """Every entry written under ``folder``, in start order."""
    entries = []
    for name in os.listdir(folder):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                entries += [json.loads(line) for line in fh if line.strip()]
    return sorted(entries, key=lambda e: e["t0"])
