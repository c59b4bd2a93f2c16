"""The process table through psutil: one reader for fedderm's process clean-up
(``deploy.loopback``, ``fedderm.console``), the benchmarks' memory sampling and the tests.

A process that is gone, or that psutil may not read (another user's), is simply not found.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import NamedTuple

import psutil

__all__ = ["ProcStat", "stat", "table", "children", "descendants", "cmdline", "environ_value"]

#: psutil's status names as the state letters of proc(5) (``Z`` = zombie)
_STATE = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_IDLE: "I",
}
_FIELDS = ("ppid", "status", "create_time")
_GONE = (psutil.Error, ProcessLookupError, PermissionError)


class ProcStat(NamedTuple):
    """A process's state letter (``Z`` = zombie), parent pid, process group and start time
    (seconds since the epoch: with the pid, it names a process even once the pid is reused)."""

    state: str
    ppid: int
    pgrp: int
    start: float


def _from_info(pid: int, info: dict) -> ProcStat | None:
    if any(info.get(k) is None for k in _FIELDS):
        return None
    try:
        pgrp = os.getpgid(pid)
    except OSError:
        return None
    return ProcStat(_STATE.get(info["status"], "?"), info["ppid"], pgrp, info["create_time"])


def stat(pid: int) -> ProcStat | None:
    """``pid``'s :class:`ProcStat`; None if it is gone (or not readable)."""
    try:
        return _from_info(pid, psutil.Process(pid).as_dict(_FIELDS))
    except _GONE:
        return None


def table(zombies: bool = False) -> dict[int, ProcStat]:
    """Every process now: pid -> :class:`ProcStat` (zombies left out unless asked)."""
    out = {}
    for proc in psutil.process_iter(_FIELDS):
        st = _from_info(proc.pid, proc.info)
        if st is not None and (zombies or st.state != "Z"):
            out[proc.pid] = st
    return out


def children(procs: dict[int, ProcStat] | None = None) -> dict[int, list[int]]:
    """Parent pid -> its child pids, from ``procs`` (default: :func:`table` now)."""
    kids: dict[int, list[int]] = defaultdict(list)
    for pid, st in (table() if procs is None else procs).items():
        kids[st.ppid].append(pid)
    return dict(kids)


def descendants(roots, procs: dict[int, ProcStat] | None = None) -> list[int]:
    """Every process below the pids ``roots`` (an int or an iterable), not the roots themselves,
    each once, parents before their children."""
    kids = children(procs)
    todo = [roots] if isinstance(roots, int) else list(roots)
    seen, out = set(todo), []
    while todo:
        for child in kids.get(todo.pop(0), ()):
            if child not in seen:
                seen.add(child)
                out.append(child)
                todo.append(child)
    return out


def cmdline(pid: int, limit: int | None = None) -> str:
    """``pid``'s command line, arguments joined by spaces (``?`` if it is gone)."""
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()[:limit]
    except _GONE:
        return "?"


def environ_value(pid: int, name: str) -> str | None:
    """The value of environment variable ``name`` in ``pid`` (as it started); None if unset, gone
    or another user's process."""
    try:
        return psutil.Process(pid).environ().get(name)
    except _GONE:
        return None
