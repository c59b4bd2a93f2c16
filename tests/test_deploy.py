"""Deployment: certificates, node config, fast polling, Docker files, stopping what a loopback
federation started, checking its results (the federations themselves: tests/test_loopback*.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid
from proc_helpers import alive as _alive
from proc_helpers import group_members as _group_members

from deploy.make_certs import make_certs
from fedderm.node import NodeConfigError, parse_node_config
from strategies.fastpoll import FastPollGrid, send_and_receive_fast

ROOT = Path(__file__).resolve().parents[1]


# -- certificates and keys ------------------------------------------------------------------
def test_make_certs_ca_server_cert_and_hospital_keys(tmp_path):
    s = make_certs(tmp_path, ["fl.example.org", "10.1.2.3", "127.0.0.1"], ["hospital-a", "hospital-b"])
    ca = x509.load_pem_x509_certificate(s.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(s.server_cert.read_bytes())
    # the SuperLink certificate is signed by the CA and valid for every host name / IP given
    ca.public_key().verify(
        cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm
    )
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # ... and for its own loopback address behind the proxy (localhost, 127.0.0.1), always
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3", "127.0.0.1"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert s.superlink_ca.read_bytes() == s.ca_cert.read_bytes()
    # one EC key pair per hospital, OpenSSH format, as flower-supernode loads it
    for paths in s.hospitals.values():
        key = serialization.load_ssh_private_key(paths["private"].read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        pub = serialization.load_ssh_public_key(paths["public"].read_bytes())
        assert pub.public_numbers() == key.public_key().public_numbers()
        assert paths["public"].read_text().startswith("ecdsa-sha2-nistp384 ")
        assert paths["private"].stat().st_mode & 0o777 == 0o600
        assert paths["ca"].read_bytes() == s.ca_cert.read_bytes()
    assert s.server_key.stat().st_mode & 0o777 == 0o600
    script = s.register_script.read_text()
    assert script.count("flwr supernode register") == 2 and "--name hospital-b" in script


def test_make_certs_keeps_ca_and_existing_keys_when_adding_a_hospital(tmp_path):
    first = make_certs(tmp_path, ["localhost"], ["hospital-a"])
    ca_before, key_before = first.ca_cert.read_bytes(), first.hospitals["hospital-a"]["private"].read_bytes()
    second = make_certs(tmp_path, ["localhost"], ["hospital-a", "hospital-b"])
    assert second.ca_cert.read_bytes() == ca_before
    assert second.hospitals["hospital-a"]["private"].read_bytes() == key_before
    assert second.hospitals["hospital-b"]["private"].exists()


@pytest.mark.parametrize("names", [["a b"], ["x", "x"], [""]])
def test_make_certs_rejects_bad_hospital_names(tmp_path, names):
    with pytest.raises(ValueError, match="hospital name"):
        make_certs(tmp_path, ["localhost"], names)


def test_make_certs_cli_prints_what_each_host_needs(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy" / "make_certs.py"),
            "--out",
            str(tmp_path),
            "--superlink-host",
            "fl.example.org",
            "--hospital",
            "h1",
            "--port",
            "9443",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "Coordinating site (SuperLink host) needs:" in out
        and "Hospital h1 (its SuperNode host) needs:" in out
    )
    # the hospitals reach the proxy's public port; the flwr CLI the SuperLink's own loopback address
    assert "--superlink fl.example.org:9443" in out and 'address = "127.0.0.1:9093"' in out
    assert "--auth-supernode-private-key" in out and "h1.key" in out


# -- node config ----------------------------------------------------------------------------
def test_node_config_parsing(tmp_path):
    n = parse_node_config(
        {
            "partition-id": 2,
            "data-path": "/data/x",
            "dataset": "folder",
            "site": "Graz",
            "state-dir": str(tmp_path / "s"),
            "unrelated-flower-key": 1,
        }
    )
    assert (n.partition_id, n.data_path, n.dataset, n.site, n.label) == (
        2,
        "/data/x",
        "folder",
        "Graz",
        "Graz",
    )
    assert n.state_dir == tmp_path / "s" and n.num_partitions == 1 and n.cache_dir is None
    # deployment without partition-id: numbered from the node id, stable and < 2**31
    m = parse_node_config({"data-path": "/d"}, node_id=15147330657080939671)
    assert m.partition_id == 15147330657080939671 % 1_000_000 and m.label == f"client {m.partition_id}"
    assert parse_node_config({"partition-id": 1, "num-partitions": 3}).num_partitions == 3


@pytest.mark.parametrize(
    "config,key",
    [
        ({"partition-id": "0"}, "partition-id"),
        ({"data-path": 3}, "data-path"),
        ({"partition-id": True}, "partition-id"),
        ({"state-dir": " "}, "state-dir"),
        ({"partition-id": 3, "num-partitions": 2}, "partition-id"),
    ],
)
def test_node_config_errors_name_the_key(config, key):
    with pytest.raises(NodeConfigError, match=key):
        parse_node_config(config)


def test_client_session_reads_its_data_and_state_dir_from_node_config(tmp_path):
    from clients.common import _SESSIONS, info, session
    from deploy.loopback import make_hospital_data

    folder = make_hospital_data(tmp_path / "data", ["h"], per_class=6, image_size=16)["h"]
    state = tmp_path / "state"
    run_config = {"model": "tiny-cnn", "image-size": 16}
    ctx = Context(
        run_id=7,
        node_id=99,
        node_config={
            "data-path": str(folder),
            "dataset": "folder",
            "partition-id": 4,
            "site": "h",
            "state-dir": str(state),
        },
        state=RecordDict(),
        run_config=run_config,
    )
    try:
        s = session(ctx)
        assert (
            s.partition_id == 4
            and len(s.data.split.train) + len(s.data.split.val) + len(s.data.split.test) == 30
        )
        assert s.cfg.cache_dir == str(state / "cache") and any((state / "cache").iterdir())
        assert s.state_path("ema/teacher.pt") == state / "ema" / "teacher.pt" and (state / "ema").is_dir()
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1  # as in a ServerApp
        msg = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=99, message_type="query.info")
        msg.metadata.__dict__["_message_id"] = msg.object_id
        reply = info(msg, ctx)
        assert reply.content["info"]["site"] == "h" and reply.content["info"]["partition-id"] == 4
        # without state-dir, asking for persistent state names the node-config key
        bare = Context(
            run_id=7,
            node_id=98,
            node_config={"data-path": str(folder), "dataset": "folder"},
            state=RecordDict(),
            run_config={**run_config, "cache-dir": str(tmp_path / "c")},
        )
        with pytest.raises(RuntimeError, match="state-dir"):
            session(bare).state_path("x")
        assert session(bare).partition_id == 98
    finally:
        _SESSIONS.clear()


# -- fast polling ---------------------------------------------------------------------------
class _Meta:
    def __init__(self, reply_to):
        self.reply_to_message_id = reply_to


class _Reply:
    def __init__(self, reply_to):
        self.metadata = _Meta(reply_to)

    def has_content(self):  # FastPollGrid unpacks every pulled reply (wire.unpack_message)
        return False


class FakeGrid(Grid):  # a flwr Grid whose replies arrive after fixed delays
    def __init__(self, delays: dict[str, float], unpushable: int = 0):
        self.delays, self.unpushable, self.pulls, self.t0 = delays, unpushable, 0, None

    def set_run(self, run): ...
    @property
    def run(self): ...
    def create_message(self, *a, **k): ...
    def get_node_ids(self):
        return [1, 2]

    def push_messages(self, messages):
        self.t0 = time.monotonic()
        return [None] * self.unpushable + list(self.delays)

    def pull_messages(self, ids):
        self.pulls += 1
        now = time.monotonic() - self.t0
        return [_Reply(i) for i in ids if self.delays[i] <= now]

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("FastPollGrid must not use the inner grid's send_and_receive")


def test_send_and_receive_fast_returns_soon_after_the_last_reply():
    grid = FakeGrid({"a": 0.05, "b": 0.3})
    t = time.monotonic()
    replies = send_and_receive_fast(grid, ["m1", "m2"], timeout=10, poll_interval=0.05)
    elapsed = time.monotonic() - t
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["a", "b"]
    assert 0.3 <= elapsed < 0.6  # Flower's HttpGrid would return at 3 s
    assert grid.pulls >= 4


def test_send_and_receive_fast_timeout_and_unpushed_messages():
    grid = FakeGrid({"a": 0.0, "b": 5.0}, unpushable=1)
    t = time.monotonic()
    replies = send_and_receive_fast(grid, ["m0", "m1", "m2"], timeout=0.3, poll_interval=0.05)
    assert 0.3 <= time.monotonic() - t < 0.6
    assert [r.metadata.reply_to_message_id for r in replies] == ["a"]


def test_fast_poll_grid_delegates_and_polls_fast():
    inner = FakeGrid({"a": 0.1})
    grid = FastPollGrid(inner, poll_interval=0.02)
    assert list(grid.get_node_ids()) == [1, 2]
    t = time.monotonic()
    assert len(list(grid.send_and_receive(["m"], timeout=5))) == 1
    assert time.monotonic() - t < 0.4 and inner.pulls >= 3


# -- Docker ---------------------------------------------------------------------------------
def test_docker_images_install_exactly_the_declared_dependencies():
    import runpy

    import tomllib

    requirements = runpy.run_path(str(ROOT / "docker" / "requirements.py"))["requirements"]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = requirements(ROOT / "pyproject.toml")
    assert len(reqs) == len(declared)
    for dep, req in zip(declared, reqs):
        if dep.startswith("flwr["):  # Flower's image has flwr; only the Ray (simulation) extra is dropped
            assert req == dep.replace("[simulation]", "")
        else:
            assert req == dep
    # fedderm's own entry points: objects in the SuperLink's memory; the warm launcher at the hospitals
    entrypoints = {"superlink": "fedderm-superlink", "supernode": "fedderm-supernode"}
    for role in ("superlink", "supernode"):
        text = (ROOT / "docker" / f"{role}.Dockerfile").read_text()
        # Flower's official image is the default base; docker/test.sh passes a locally made one
        assert f"ARG BASE_IMAGE=flwr/{role}:${{FLWR_TAG}}" in text and "FROM ${BASE_IMAGE}" in text
        assert "ubuntu" in text
        assert "requirements.py /app/build/pyproject.toml > /app/build/requirements.txt" in text
        assert "-r /app/build/requirements.txt" in text and "requirements.py --check" in text
        assert f'ENTRYPOINT ["{entrypoints[role]}"]' in text
        # the entry point is fedderm's core package, installed without dependencies (all above)
        assert "COPY --chown=app:app fedderm /app/build/fedderm" in text
        assert "pip install --no-cache-dir --no-deps ${PIP_ARGS} /app/build" in text
    assert set((ROOT / ".dockerignore").read_text().split()) >= {
        "*",
        "!pyproject.toml",
        "!docker/requirements.py",
    }


def _command(service: dict) -> str:
    return " ".join(service["command"])


def test_compose_file_superlink_and_supernodes_with_tls_auth_and_own_data():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yml").read_text())
    services = compose["services"]
    link = _command(services["superlink"])
    for flag in (
        "--ssl-ca-certfile",
        "--ssl-certfile",
        "--ssl-keyfile",
        "--enable-supernode-auth",
        "--disable-runtime-dependency-installation",
        "--database",
    ):
        assert flag in link
    assert "--insecure" not in link
    # the SuperLink on the host's loopback only; the proxy (nginx, deploy/proxy.py --docker) on the
    # public port, with the SuperLink's certificates and the generated nginx.conf
    assert "--host=127.0.0.1" in link and "--host=0.0.0.0" not in link
    assert services["superlink"]["network_mode"] == "host" and "ports" not in services["superlink"]
    front = services["proxy"]
    assert front["build"]["dockerfile"] == "docker/proxy.Dockerfile" and front["network_mode"] == "host"
    assert any(v.endswith("/superlink:/etc/fedderm/certs:ro") for v in front["volumes"])
    assert any(v.endswith("/proxy/nginx.conf:/etc/fedderm/nginx.conf:ro") for v in front["volumes"])
    nodes = {name: s for name, s in services.items() if name.startswith("supernode")}
    assert len(nodes) >= 3
    data_mounts, pids, keys = set(), set(), set()
    for name, s in nodes.items():
        cmd = _command(s)
        assert (
            "--root-certificates" in cmd and "--auth-supernode-private-key" in cmd and "--insecure" not in cmd
        )
        assert 'data-path="/data"' in cmd and 'state-dir="/app/state"' in cmd
        assert "--superlink=host.docker.internal:${SUPERLINK_PORT:-8000}" in cmd  # through the proxy
        pids.add(cmd.split("partition-id=")[1].split()[0])
        keys.add(cmd.split("--auth-supernode-private-key=")[1].split()[0])
        data = [v for v in s["volumes"] if v.endswith(":/data:ro")]
        assert len(data) == 1, f"{name} must mount exactly one read-only data folder"
        data_mounts.add(data[0])
        assert s["build"]["dockerfile"] == "docker/supernode.Dockerfile"
        # only app bundles the hospital approved run (fedderm-supernode --allow-list)
        assert "--allow-list=/app/approved.txt" in cmd
        assert any(v.endswith(":/app/approved.txt:ro") for v in s["volumes"])
    assert len(data_mounts) == len(pids) == len(nodes)  # every hospital its own data and id


def _compose_cli() -> list[str] | None:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if (
        shutil.which("docker-compose")
        and subprocess.run(["docker-compose", "version"], capture_output=True, env=clean).returncode == 0
    ):
        return ["docker-compose"]  # a CLI that is installed but cannot start counts as absent
    return None


@pytest.mark.skipif(
    _compose_cli() is None, reason="neither `docker compose` nor `docker-compose` is installed"
)
def test_compose_files_validate_with_the_compose_cli():
    cli = _compose_cli()
    # Ray puts the repo on PYTHONPATH during simulations; the repo's docker/ folder must not
    # shadow the `docker` package of a Python docker-compose
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [*cli, "-f", str(ROOT / "docker" / "compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=clean,
    )
    assert res.returncode == 0, res.stderr
    env = {
        **clean,
        "SUPERLINK_ADDRESS": "fl.example.org:8000",
        "HOSPITAL": "hospital-a",
        "PARTITION_ID": "0",
        "KEYS_DIR": "/keys",
        "DATA_DIR": "/data",
        "ALLOW_LIST": "/etc/fedderm/approved.txt",
    }
    res = subprocess.run(
        [*cli, "-f", str(ROOT / "docker" / "hospital.yml"), "config"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert "--auth-supernode-private-key=/app/certs/hospital-a.key" in res.stdout
    assert "--allow-list=/app/approved.txt" in res.stdout
    # a hospital that forgets its SuperLink address is told which variable is missing
    env.pop("SUPERLINK_ADDRESS")
    res = subprocess.run(
        [*cli, "-f", str(ROOT / "docker" / "hospital.yml"), "config"], capture_output=True, text=True, env=env
    )
    assert res.returncode != 0 and "SUPERLINK_ADDRESS" in res.stderr


def test_stop_ends_the_whole_process_group(tmp_path):
    from deploy.loopback import Loopback

    fed = Loopback(tmp_path, 1)
    child_pid = tmp_path / "child.pid"
    proc = fed.spawn("sleeper", ["sh", "-c", f"sleep 300 & echo $! > {child_pid}; wait"], home="x")
    deadline = time.monotonic() + 10
    while not child_pid.exists() or not child_pid.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(child_pid.read_text())
    assert _alive(proc.popen.pid) and _alive(child)
    fed.stop()
    assert not _alive(proc.popen.pid) and not _alive(child) and fed.procs == []
    assert _group_members({proc.popen.pid}) == []


_DETACH = """
import subprocess, sys
# a grandchild in a session of its own, as Flower's SuperLink starts its SuperExec (and ServerApp)
child = subprocess.Popen(["sleep", "300"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "stay":
    child.wait()
"""


def _start_detaching(fed, tmp_path, name: str, mode: str) -> tuple[object, int]:
    """Spawn (through ``fed``) a process that starts a grandchild outside its process group;
    ``mode`` 'exit': the middle process exits at once, leaving the grandchild an orphan."""
    pid_file = tmp_path / f"{name}.pid"
    proc = fed.spawn(name, [sys.executable, "-c", _DETACH, str(pid_file), mode], home="x")
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, f"{name} did not start its grandchild"
        time.sleep(0.05)
    return proc, int(pid_file.read_text())


def test_stop_and_kill_end_descendants_that_left_the_group_and_orphans(tmp_path):
    """A child in a session of its own (the SuperLink's SuperExec and
    ServerApp) or already orphaned survives a process-group kill; stop() and kill() end it too,
    and leave a process the test itself started (not through Loopback) alone."""
    from deploy.loopback import Loopback

    fed = Loopback(tmp_path, 1)
    unrelated = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        staying, grandchild = _start_detaching(fed, tmp_path, "staying", "stay")
        gone, orphan = _start_detaching(fed, tmp_path, "gone", "exit")
        assert gone.popen.wait(timeout=30) == 0  # the orphan's parent has exited
        other, other_child = _start_detaching(fed, tmp_path, "other", "stay")
        assert all(_alive(p) for p in (staying.popen.pid, grandchild, orphan, other_child))
        assert {grandchild, orphan, other_child} <= set(fed.processes())
        fed.kill("staying")  # one name: its descendant goes, the others stay
        assert not _alive(staying.popen.pid) and not _alive(grandchild)
        assert _alive(orphan) and _alive(other_child) and _alive(unrelated.pid)
        fed.stop()
        assert not _alive(orphan) and not _alive(other_child) and not _alive(other.popen.pid)
        assert fed.processes() == {} and fed.procs == []
        assert _alive(unrelated.pid)  # not started by the Loopback: never signalled
    finally:
        unrelated.kill()
        unrelated.wait()
        fed.stop()


def test_sigterm_inside_a_loopback_block_stops_its_federation(tmp_path):
    """Whoever runs a federation in ``with Loopback(...)`` (``python -m bench.deployment``, a
    script) has it stopped by a SIGTERM too: the signal unwinds through ``__exit__`` (exit 143)."""
    script = (
        "import os, signal, sys\n"
        "from deploy.loopback import Loopback\n"
        f"fed = Loopback({str(tmp_path / 'fed')!r}, 1)\n"
        "fed.stop = lambda: print('federation stopped', flush=True)\n"
        "with fed:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    signal.pause()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 143, out.stderr[-2000:]
    assert out.stdout.strip() == "federation stopped"


def test_loopback_result_check_catches_incomplete_runs(tmp_path):

    from deploy.loopback import RunOutcome, check_results, run_config_arg

    run_dir = tmp_path / "fedavg"
    run_dir.mkdir()
    for name in ("model.pt", "model-best.pt", "rounds.csv"):
        (run_dir / name).write_bytes(b"x")
    client = {"balanced_accuracy": 0.5, "num-examples": 10}
    summary = {
        "method": "fedavg",
        "rounds": [{"round": 0}, {"round": 1}],
        "final": {"per_client": {"0": client, "1": client, "2": client}},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    good = RunOutcome("fedavg", 1, "finished:completed", run_dir, 1.0)
    assert check_results(good, 3, 1) == []
    failed = RunOutcome("fedavg", 1, "finished:failed", run_dir, 1.0)
    assert any("finished:failed" in p for p in check_results(failed, 3, 1))
    assert any("expected 4" in p for p in check_results(good, 4, 1))  # a hospital without final metrics
    assert any("expected up to 2" in p for p in check_results(good, 3, 2))  # a round missing
    (run_dir / "model.pt").unlink()
    assert any("model.pt" in p for p in check_results(good, 3, 1))
    assert run_config_arg({"a": 1, "b": "x y", "c": True, "d": 0.5}) == 'a=1 b="x y" c=true d=0.5'
