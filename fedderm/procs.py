"""The process table through psutil: one reader for fedderm's process clean-up
(``deploy.loopback``, ``fedderm.console``), the benchmarks' memory sampling and the tests.

A process that is gone, or that psutil may not read (another user's), is simply not found.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import NamedTuple

import psutil

__all__ = [
    "ProcStat",
    "stat",
    "table",
    "children",
    "descendants",
    "cmdline",
    "environ_value",
    "own_pids",
    "tagged",
    "stop_tree",
]

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


def own_pids() -> list[int]:
    """The pids of this user's live processes (zombies left out)."""
    me = os.getuid()
    out = []
    for proc in psutil.process_iter(["uids", "status"]):
        uids = proc.info.get("uids")
        if uids is not None and uids.real == me and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            out.append(proc.pid)
    return out


def tagged(name: str, value: str) -> list[int]:
    """This user's live processes whose environment has ``name=value`` (a tag a test or a
    launcher set, which every process started below inherits)."""
    return [pid for pid in own_pids() if pid != os.getpid() and environ_value(pid, name) == value]


def stop_tree(roots, grace: float = 5.0) -> list[int]:
    """Stop the processes ``roots`` (an int or an iterable of pids) and every process below them:
    SIGTERM to all (as found before any is stopped, so that orphans are not missed), then SIGKILL
    to those still alive after ``grace`` seconds.  Returns the pids it signalled."""
    roots = [roots] if isinstance(roots, int) else list(roots)
    pids = [*roots, *descendants(roots)]
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.terminate()
            procs.append(proc)
        except _GONE:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except _GONE:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return [p.pid for p in procs]
