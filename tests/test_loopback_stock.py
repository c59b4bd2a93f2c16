"""Flower as it ships: a loopback federation of stock `flower-superlink` / `flower-supernode`
processes (TLS, node auth) with fedderm only as the app; and `python -m deploy.loopback` stopped by a
SIGTERM mid-run leaving none of its processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from proc_helpers import alive as _alive
from proc_helpers import skip_loopback, wait_for

from fedderm import procs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.federation, skip_loopback]


def test_stock_flower_loopback_federation_tls_node_auth(tmp_path):
    """Flower as it ships: `flower-superlink` and `flower-supernode` of the installed Flower,
    unmodified (TLS, SuperNode authentication, no fedderm accelerator), fedderm only as the app run
    with `flwr run`, the SuperLink on loopback behind the proxy: a FedAvg round completes with
    every hospital's test result, an unregistered SuperNode is refused, and an outsider holding
    the CA certificate can neither register, list, stop nor submit anything at the public address
    (tests/test_adversary_deploy.py)."""
    from test_adversary_deploy import assert_outsider_refused

    from deploy.loopback import BASE_RUN_CONFIG, Loopback

    lines: list[str] = []
    fed = Loopback(tmp_path / "fed", 2, per_class=8, echo=lines.append, launcher="flower")
    try:
        fed.start()
        started = fed.processes()
        assert not any("fedderm.accel" in cmd for cmd in started.values()), started
        assert sum("flower-supernode" in cmd for cmd in started.values()) == 2, started
        assert fed.try_outsider()["refused"]
        out = fed.run("fedavg", {**BASE_RUN_CONFIG, "num-server-rounds": 1}, timeout=600)
        assert out.ok, "\n".join(out.problems)
        assert out.status == "finished:completed" and set(out.summary["final"]["per_client"]) == {"0", "1"}
        assert_outsider_refused(fed)
    finally:
        fed.stop()


def test_sigterm_to_the_loopback_command_mid_run_leaves_none_of_its_processes(tmp_path):
    """`python -m deploy.loopback` killed with SIGTERM while a run is going (a CI timeout, a
    closed terminal): it exits and no process it started (SuperLink, SuperNodes, their SuperExecs,
    ServerApp, ClientApps, the flwr CLI) is left alive."""
    import signal

    from deploy.loopback import TAG_VAR

    workdir = tmp_path / "fed"
    # one hospital: every kind of process the command starts, each once
    cmd = [sys.executable, "-m", "deploy.loopback", "--hospitals", "1", "--rounds", "3", "--method", "fedavg"]
    proc = subprocess.Popen(
        [*cmd, "--workdir", str(workdir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )

    def family() -> list[int]:
        tag = f"{proc.pid}."
        return [
            pid
            for pid in procs.table()
            if pid != proc.pid and (procs.environ_value(pid, TAG_VAR) or "").startswith(tag) and _alive(pid)
        ]

    try:
        serverapp = lambda: [pid for pid in family() if "flwr-serverapp" in procs.cmdline(pid)]  # noqa: E731
        wait_for(lambda: serverapp() and any(workdir.glob("results/*/summary.json")), "the run's start", 600)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
        left = {pid: procs.cmdline(pid, 200) for pid in family()}
        assert left == {}, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
