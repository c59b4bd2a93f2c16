"""fedderm.procs, the one /proc reader of process clean-up, benchmarks and tests."""

import os
import subprocess
import sys
import time

import pytest

from fedderm import procs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")


def test_descendants_stat_cmdline_and_environ_of_a_process_tree():
    # a child that starts a grandchild with a tagged environment, then both wait
    code = (
        "import os, subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], "
        "env={**os.environ, 'FEDDERM_PROCS_TEST': 'tree/a'}); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.time() + 20
        while len(procs.descendants(child.pid)) < 1 and time.time() < deadline:
            time.sleep(0.05)
        (grandchild,) = procs.descendants(child.pid)
        assert child.pid in procs.descendants(os.getpid())
        assert procs.descendants(os.getpid()).index(child.pid) < procs.descendants(os.getpid()).index(
            grandchild
        )
        st = procs.stat(grandchild)
        assert st.ppid == child.pid and st.pgrp == child.pid and st.state != "Z"
        assert procs.stat(grandchild).start == st.start  # a process's start time does not change
        assert procs.table()[grandchild] == procs.stat(grandchild)
        assert procs.cmdline(grandchild).endswith("import time; time.sleep(30)")
        assert procs.environ_value(grandchild, "FEDDERM_PROCS_TEST") == "tree/a"
        assert procs.environ_value(child.pid, "FEDDERM_PROCS_TEST") is None
        assert procs.children()[child.pid] == [grandchild]
    finally:
        os.killpg(child.pid, 9)
        child.wait()
    time.sleep(0.2)
    assert procs.stat(child.pid) is None  # reaped: gone
    assert procs.cmdline(child.pid) == "?" and procs.descendants(child.pid) == []
