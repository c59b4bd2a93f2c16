"""Helpers of the tests that start real processes (loopback federations, ``flwr run``): is a
process alive, which processes are in given process groups, wait for a condition."""

from __future__ import annotations

import os
import time

import pytest

from fedderm import procs

#: the real-process loopback federations, skipped with FEDDERM_SKIP_LOOPBACK=1
skip_loopback = pytest.mark.skipif(
    os.environ.get("FEDDERM_SKIP_LOOPBACK") == "1",
    reason="FEDDERM_SKIP_LOOPBACK=1: the real-process loopback federation was skipped",
)


def alive(pid: int) -> bool:
    st = procs.stat(pid)
    return st is not None and st.state != "Z"


def group_members(pgids: set[int]) -> list[str]:
    """Live processes whose process group is one of ``pgids`` (what a Loopback started)."""
    return [f"{pid}: {procs.cmdline(pid, 200)!r}" for pid, st in procs.table().items() if st.pgrp in pgids]


def wait_for(predicate, what: str, timeout: float = 600, every: float = 0.2):
    """Poll ``predicate`` until it returns a true value and return that value; fail naming ``what``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)
    return value
