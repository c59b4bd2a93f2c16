"""The Linux process table, read from ``/proc``: one reader for fedderm's process clean-up
(``deploy.loopback``, ``fedderm.console``), the benchmarks' memory sampling and the tests.

Elsewhere (no ``/proc``) the table is empty: nothing is found, nothing is signalled.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import NamedTuple

__all__ = ["ProcStat", "stat", "table", "children", "descendants", "cmdline", "environ_value"]


class ProcStat(NamedTuple):
    """Fields of ``/proc/<pid>/stat`` (proc(5)): state letter (``Z`` = zombie), parent pid, process
    group, start time in clock ticks after boot (with the pid, it names a process even once the pid
    is reused)."""

    state: str
    ppid: int
    pgrp: int
    start: int


def stat(pid: int) -> ProcStat | None:
    """``pid``'s :class:`ProcStat`; None if it is gone (or not readable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
        # the command name (field 2) may hold spaces and parentheses: split after its last ")"
        fields = raw.rsplit(")", 1)[1].split()
        return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def table(zombies: bool = False) -> dict[int, ProcStat]:
    """Every process now in ``/proc``: pid -> :class:`ProcStat` (zombies left out unless asked)."""
    out = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if name.isdigit() and (st := stat(int(name))) is not None and (zombies or st.state != "Z"):
            out[int(name)] = st
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
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:limit]


def environ_value(pid: int, name: str) -> str | None:
    """The value of environment variable ``name`` in ``pid`` (as it started); None if unset, gone
    or another user's process."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            entries = fh.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{name}=".encode()
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None
