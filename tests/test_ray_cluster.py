"""``sim.py --ray-address``: a simulation on a running two-node Ray cluster (loopback) gives the numbers
of the same run on one machine (docs/gpu.md)."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

import sim

RUN = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 10,
    "num-server-rounds": 2,
    "local-epochs": 1,
    "batch-size": 16,
    "lr": 0.05,
    "min-clients": 2,
    "seed": 3,
}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _ray_start(args: list[str], temp_dir: str, log: Path) -> subprocess.Popen:
    """One ``ray start --block`` node in its own session (so that all it spawns can be stopped by
    its process group) with its own temp dir and ports, 1 CPU, no GPU."""
    agent, grpc, metrics, runtime_env = _free_ports(4)
    cmd = ["ray", "start", *args, "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir]
    cmd += ["--num-cpus", "1", "--num-gpus", "0", "--block", "--disable-usage-stats"]
    cmd += ["--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(grpc)]
    cmd += ["--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ``ray start --block`` (it stops its node's processes), then SIGKILL whatever of its
    process group is left: only the processes this test started."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _nodes_alive(address: str) -> int:
    """Active nodes of the cluster at ``address`` (0 while it does not answer)."""
    try:
        out = subprocess.run(
            ["ray", "status", "--address", address], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:  # a loaded machine: ask again until the fixture's deadline
        return 0
    return out.stdout.count(" node_") if out.returncode == 0 else 0


@pytest.fixture
def two_node_cluster():
    """A head node and a second node on 127.0.0.1; yields (address, [temp dir of each node])."""
    if shutil.which("ray") is None:
        pytest.skip("the `ray` command is not installed (flwr[simulation] brings it)")
    root = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    port, client_port = _free_ports(2)
    address = f"127.0.0.1:{port}"
    head_args = ["--head", "--port", str(port), "--ray-client-server-port", str(client_port)]
    procs = [_ray_start([*head_args, "--include-dashboard", "false"], f"{root}/head", Path(root, "head.log"))]
    try:
        deadline = time.monotonic() + 180
        while _nodes_alive(address) < 1:
            if procs[0].poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"Ray could not start a head node: {Path(root, 'head.log').read_text()[-500:]}")
            time.sleep(2)
        procs.append(_ray_start(["--address", address], f"{root}/node2", Path(root, "node2.log")))
        while _nodes_alive(address) < 2:
            if procs[1].poll() is not None or time.monotonic() > deadline:
                reason = Path(root, "node2.log").read_text()[-500:]
                pytest.skip(f"Ray could not start a second node on this machine: {reason}")
            time.sleep(2)
        yield address, [Path(root, "head"), Path(root, "node2")]
    finally:
        for proc in reversed(procs):
            _stop(proc)
        if os.environ.get("FEDDERM_KEEP_RAY_LOGS"):
            print(f"Ray logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _run(tmp_path: Path, name: str, ray_address: str = "") -> tuple[dict, dict]:
    """The run on the cluster at ``ray_address``; without one, in this process (bench/loop_grid.py:
    the numbers of a local single-node Ray, which tests/test_cli.py's Ctrl-C test compares)."""
    from bench.loop_grid import simulate

    out = {**RUN, "output-dir": str(tmp_path / name), "cache-dir": str(tmp_path / "cache"), "run-name": "r"}
    run_dir = (sim.simulate if ray_address else simulate)(out, num_supernodes=2, ray_address=ray_address)
    return json.loads((run_dir / "summary.json").read_text()), torch.load(run_dir / "model.pt")


@pytest.mark.federation
def test_ray_address_two_node_cluster_gives_the_single_node_numbers(tmp_path, two_node_cluster):
    address, node_dirs = two_node_cluster
    local, local_model = _run(tmp_path, "local")
    cluster, cluster_model = _run(tmp_path, "cluster", address)
    # the second node ran a ClientApp actor: Ray names the actor in that node's worker logs
    actors = [
        p
        for p in node_dirs[1].glob("session_*/logs/worker-*.out")
        if ":actor_name:ClientAppActor" in p.read_text()
    ]
    assert actors, "no ClientApp ran on the second node"
    assert [r["round"] for r in cluster["rounds"] if r["split"] == "val"] == [0, 1, 2]
    assert cluster["rounds"] == local["rounds"]
    assert cluster["final"] == local["final"]
    assert local_model.keys() == cluster_model.keys()
    assert all(torch.equal(local_model[k], cluster_model[k]) for k in local_model)
