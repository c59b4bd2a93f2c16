"""A real fedderm federation on this machine: one SuperLink and N SuperNodes as separate processes
on 127.0.0.1, with TLS and SuperNode authentication, each hospital with its own data folder.

    python -m deploy.loopback                       # 3 hospitals, every method of METHODS present
    python -m deploy.loopback --method fedavg --rounds 2 --workdir /tmp/loopback --keep

What it does, in order (the output says each step):
 1. generates a small image folder per hospital (``<class>/<image>.png``, one synthetic site each);
 2. creates a CA, the SuperLink certificate (SAN 127.0.0.1, localhost) and a key pair per hospital
    plus one for an outsider (``deploy/make_certs.py``);
 3. starts ``fedderm-superlink`` (or ``flower-superlink``: TLS, ``--enable-supernode-auth``,
    runtime dependency installation off) on 127.0.0.1 and, in front of it on a port of its own,
    the proxy (nginx, ``deploy/proxy.py``: the Fleet API only); registers the hospitals' public keys
    with ``flwr supernode register`` on the SuperLink's own address, as the coordinator does;
 4. starts one SuperNode per hospital, connected through the proxy, with ``--node-config`` naming
    its own ``data-path``, ``dataset``, ``partition-id``, ``site`` and ``state-dir``; waits until all
    are online;
 5. checks that an outsider holding the CA certificate is refused at the proxy's address (``flwr
    supernode register``, ``flwr ls``: 403), and that a SuperNode with the outsider's
    (unregistered) key is refused;
 6. ``flwr run``s each method and checks its results folder (``summary.json``: every hospital
    has final test metrics, every round is there) and that Flower reports the run completed;
 7. stops every process it started and every process those started (process group, descendants,
    and an environment tag they inherit, so also one in a session of its own), also on failure.

Every process gets its own ``FLWR_HOME`` under the work folder, ports are picked free, and
nothing else on the machine is touched.  Exit code 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]

from deploy import proxy as _proxy  # noqa: E402
from deploy.make_certs import make_certs  # noqa: E402
from fedderm import procs  # noqa: E402
from fedderm.accel.allow import copy_bundle_files  # noqa: E402

# The methods the loopback federation runs, with their extra run config.  Methods not (yet) in
# this build's registry are skipped with a note, so a new method is one line here.
METHODS: dict[str, dict] = {
    "fedavg": {},
    "sift": {},  # the ring method (paper 002): messages hop from hospital to hospital
}
# Small and fast: a tiny CNN on 32 px images, one local epoch.
BASE_RUN_CONFIG = {
    "model": "tiny-cnn",
    "image-size": 32,
    "local-epochs": 1,
    "batch-size": 16,
    "optimizer": "sgd",
    "lr": 0.05,
    "lr-schedule": "constant",
    "seed": 0,
}
CONNECTION = "loopback"
OUTSIDER = "outsider"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (chosen by the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def make_hospital_data(
    root: Path, hospitals: list[str], per_class: int = 12, image_size: int = 32, seed: int = 0
) -> dict[str, Path]:
    """One ImageFolder per hospital (``root/<hospital>/<class>/<n>.png``), each a different
    synthetic site (its own skin tone and lighting), as a hospital's export would look."""
    from PIL import Image

    from fedderm.data.synthetic import generate

    pool = generate(len(hospitals), per_class, image_size, seed)
    folders = {}
    for site, name in enumerate(hospitals):
        folder = root / name
        for i in (i for i in range(len(pool)) if pool.sites[i] == site):
            target = folder / pool.classes[pool.labels[i]] / f"{i:05d}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pool.images[i].permute(1, 2, 0).numpy()).save(target)
        folders[name] = folder
    return folders


def _bin(name: str) -> str:
    """A Flower executable from the running interpreter's environment (else from PATH)."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH: install flwr")
    return found


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def run_config_arg(config: dict) -> str:
    """``{'a': 1, 'b': 'x'}`` -> ``a=1 b="x"`` (``flwr run --run-config`` syntax)."""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in config.items())


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class RunOutcome:
    method: str
    run_id: int | None
    status: str
    run_dir: Path
    wall_s: float
    summary: dict | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(143)


class Loopback:
    """Start, use and stop a TLS + node-auth federation on 127.0.0.1 (a context manager)."""

    #: the SuperLink's ``--database``: a file under the work folder, or Flower's ``:flwr-in-memory:``
    #: (its default: link state and object store in the process's memory, nothing kept on restart)
    database = "superlink.db"

    def __init__(
        self,
        workdir: str | Path,
        num_hospitals: int = 3,
        *,
        fast_superexec: bool = True,
        per_class: int = 12,
        image_size: int = 32,
        echo=print,
        launcher: str = "warm",
        allow_lists: dict[str, Path] | None = None,
        proxy: bool = True,
    ):
        self.workdir = Path(workdir).resolve()
        self.hospitals = [f"hospital-{chr(ord('a') + i)}" for i in range(num_hospitals)]
        self.fast_superexec, self.per_class, self.image_size = fast_superexec, per_class, image_size
        self.echo = echo
        if launcher not in ("warm", "flower"):
            raise ValueError(f"launcher must be 'warm' or 'flower', not {launcher!r}")
        # warm: fedderm.accel (one pre-warmed, forked ClientApp per message, idle waits cut to
        # FEDDERM_POLL_INTERVAL, the hospital's allow-list checked); flower: Flower's own processes
        self.launcher = launcher
        # the proxy (nginx) in front: the SuperNodes connect to it, the flwr CLI to the SuperLink
        self.proxy = proxy
        self.allow_lists: dict[str, Path] = dict(allow_lists or {})
        self.procs: list[Proc] = []
        # every process started here carries TAG_VAR=<tag>/<name>, and so do their children
        self.tag = f"{os.getpid()}.{uuid.uuid4().hex[:12]}"
        self.port: int | None = None  # the SuperLink's own port (127.0.0.1): the coordinator's flwr
        self.public_port: int | None = None  # the proxy's: what the hospitals (and an outsider) reach
        self.node_ids: dict[str, int] = {}
        self.secrets = None
        self.data: dict[str, Path] = {}
        # what `flwr run` ships: a copy of the app's bundle files (made by prepare()), so that each
        # run's bundle build does not walk a virtual environment inside the checkout
        self.app_dir = self.workdir / "app"

    # -- processes -----------------------------------------------------------------------
    def env(self, home: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "FLWR_HOME": str(self.workdir / "homes" / home),
                "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                # the app's code wins over any installed copy of fedderm (e.g. an editable install
                # of another checkout); the FAB that flwr run ships is this same folder
                "PYTHONPATH": os.pathsep.join([str(APP_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
                "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            }
        )
        if self.fast_superexec and home != "superlink":
            # Flower's SuperExec checks for new work every 1 s by default (0.01-60 s allowed); the
            # SuperLink's own SuperExec only starts a run's ServerApp: its 1 s poll (10 requests a
            # second less at the SuperLink) delays a run's start by at most 1 s
            env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.1"
        (self.workdir / "homes" / home).mkdir(parents=True, exist_ok=True)
        return env

    def spawn(self, name: str, argv: list[str], home: str) -> Proc:
        """Start ``argv`` in a new session (its own process group, so it and every child it
        spawns — SuperExec, ServerApp, ClientApps — can be stopped together)."""
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env(home), TAG_VAR: f"{self.tag}/{name}"},
                cwd=self.workdir,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def flwr(self, *args: str, timeout: float = 120, home: str = "cli") -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI (own process group; killed on timeout): the coordinator's, on the
        SuperLink's own address; ``home="outsider-cli"``: an outsider's, on the public address
        (:meth:`outsider_flwr`)."""
        popen = subprocess.Popen(
            [_bin("flwr"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**self.env(home), "COLUMNS": "200", TAG_VAR: f"{self.tag}/flwr"},
            cwd=self.workdir,
            start_new_session=True,
            text=True,
        )
        proc = Proc("flwr " + " ".join(args[:2]), popen, Path(os.devnull))
        self.procs.append(proc)  # so that stop() ends it if we are interrupted meanwhile
        try:
            out, _ = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_groups([popen])
            out, _ = popen.communicate()
            raise TimeoutError(
                f"flwr {' '.join(args)} did not finish within {timeout:.0f} s:\n{out[-3000:]}"
            ) from None
        finally:
            if popen.poll() is not None:
                self.procs.remove(proc)
        return subprocess.CompletedProcess(popen.args, popen.returncode, out, "")

    def stop(self) -> None:
        """Stop every process this object started and every process those started (also one in
        a session of its own, or orphaned): SIGTERM, then SIGKILL what is left after 15 s."""
        _stop_groups([proc.popen for proc in reversed(self.procs)], tags=[f"{self.tag}/"])
        self.procs.clear()

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process this object started or that descends from
        one (found by the TAG_VAR its children inherit, so an orphan too)."""
        return {pid: procs.cmdline(pid) for pid in _family([], [f"{self.tag}/"])}

    def __enter__(self) -> Loopback:
        """Inside ``with``, a SIGTERM (a CI or benchmark timeout) unwinds like Ctrl-C, so that
        ``__exit__`` still stops the federation; a handler set by the caller is kept."""
        self._sigterm = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)

    # -- the federation ------------------------------------------------------------------
    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.app_dir, ignore_errors=True)
        copy_bundle_files(APP_DIR, self.app_dir)
        self.data = make_hospital_data(self.workdir / "data", self.hospitals, self.per_class, self.image_size)
        self.echo(
            f"data: {len(self.hospitals)} hospitals, {self.per_class} images per class each, "
            f"under {self.workdir / 'data'}"
        )
        self.secrets = make_certs(
            self.workdir / "secrets",
            ["127.0.0.1", "localhost"],
            [*self.hospitals, OUTSIDER],
            connection=CONNECTION,
        )
        self.echo(
            f"certificates: CA, SuperLink (SAN 127.0.0.1, localhost), {len(self.hospitals) + 1} "
            f"EC key pairs under {self.secrets.out}"
        )

    def start_superlink(self, timeout: float = 60, database: str | None = None) -> None:
        database = database or self.database
        s = self.secrets
        self.port = free_port()
        # fedderm-superlink: link state and objects in memory, registrations in --database (warm launcher)
        command = [_bin("flower-superlink")]
        if self.launcher != "flower":
            command = [sys.executable, "-m", "fedderm.accel", "superlink"]
        self.spawn(
            "superlink",
            [
                *command,
                "--ssl-ca-certfile",
                str(s.superlink_ca),
                "--ssl-certfile",
                str(s.server_cert),
                "--ssl-keyfile",
                str(s.server_key),
                "--enable-supernode-auth",
                "--disable-runtime-dependency-installation",
                "--database",
                database if database.startswith(":") else str(self.workdir / database),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            home="superlink",
        )
        self.cli_config("cli", f"127.0.0.1:{self.port}")
        deadline = time.monotonic() + timeout
        while not listening(self.port) and time.monotonic() < deadline:  # no `flwr` process per poll
            self._check_alive("superlink")
            time.sleep(0.2)
        while True:
            self._check_alive("superlink")
            res = self.flwr("supernode", "list", CONNECTION, "--format", "json", timeout=60)
            if _json_tail(res.stdout).get("success"):  # flwr exits 0 on connection errors too
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the SuperLink did not answer within {timeout:.0f} s "
                    f"(log: {self.workdir / 'logs' / 'superlink.log'})"
                )
            time.sleep(1)
        self.echo(
            f"superlink: up on 127.0.0.1:{self.port} (TLS, SuperNode authentication on, "
            "runtime dependency installation off)"
        )
        if self.proxy:
            self.start_proxy(timeout=max(5.0, deadline - time.monotonic()))
        else:
            self.public_port = None
            self.echo(
                "proxy: none (--no-proxy): the SuperNodes reach every API of the SuperLink, the Control API too"
            )

    @property
    def public_address(self) -> str:
        """Where the hospitals connect: the proxy, or the SuperLink itself without one."""
        return f"127.0.0.1:{self.public_port or self.port}"

    def cli_config(self, home: str, address: str) -> Path:
        """A ``flwr`` CLI home whose connection :data:`CONNECTION` is ``address`` with the CA
        certificate (all an outsider needs besides the address: every hospital holds it)."""
        config = self.workdir / "homes" / home / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{address}"\nroot-certificates = "{self.secrets.ca_cert}"\n'
        )
        return config

    def start_proxy(self, timeout: float = 30) -> None:
        """nginx on a port of its own in front of the SuperLink (``deploy/proxy.py``): the Fleet
        API is forwarded, every other request refused with 403."""
        for proc in [p for p in self.procs if p.name == "proxy"]:
            _stop_groups([proc.popen], tags=[f"{self.tag}/proxy"])
            self.procs.remove(proc)
        nginx = _proxy.find_nginx()  # a clear error naming the package when it is missing
        s = self.secrets
        self.public_port = free_port()
        prefix = self.workdir / "proxy"
        cfg = _proxy.ProxyConfig(
            "127.0.0.1", self.public_port, "127.0.0.1", self.port, s.server_cert, s.server_key, s.superlink_ca
        )
        conf = _proxy.write_standalone(cfg, prefix)
        problem = _proxy.check_config(conf, prefix, nginx)
        if problem:
            raise RuntimeError(f"nginx refuses the proxy configuration {conf}: {problem}")
        self.spawn("proxy", _proxy.nginx_argv(conf, prefix, nginx), home="proxy")
        deadline = time.monotonic() + timeout
        while not listening(self.public_port):
            self._check_alive("proxy")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the proxy did not listen within {timeout:.0f} s ({prefix / 'error.log'})"
                )
            time.sleep(0.1)
        self.cli_config("outsider-cli", self.public_address)
        self.echo(
            f"proxy: nginx on 127.0.0.1:{self.public_port} -> the SuperLink's Fleet API only "
            f"(config {conf}); the hospitals connect here"
        )

    def outsider_flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The ``flwr`` CLI of an outsider who holds the CA certificate and reaches the public address."""
        return self.flwr(*args, timeout=timeout, home="outsider-cli")

    def try_outsider_admin(self) -> dict:
        """An outsider with the CA certificate tries to register its own key and to list the runs
        at the public address; return what happened (``refused``: neither worked)."""
        before = self.registered()
        reg = self.outsider_flwr(
            "supernode", "register", str(self.secrets.hospitals[OUTSIDER]["public"]), CONNECTION,
            "--format", "json",
        )  # fmt: skip
        ls = self.outsider_flwr("ls", CONNECTION, "--format", "json")
        registered = self.registered() - before
        refused = (
            not _json_tail(reg.stdout).get("success")
            and not _json_tail(ls.stdout).get("success")
            and not registered
        )
        return {"refused": refused, "register": reg.stdout, "ls": ls.stdout, "new_nodes": registered}

    def registered(self) -> set[int]:
        """Every node the SuperLink knows (registered, online or offline), asked by the coordinator."""
        res = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        return {int(n["node-id"]) for n in _json_tail(res.stdout).get("nodes", [])}

    def register(self, name: str) -> int:
        res = self.flwr(
            "supernode",
            "register",
            str(self.secrets.hospitals[name]["public"]),
            CONNECTION,
            "--name",
            name,
            "--format",
            "json",
        )
        data = _json_tail(res.stdout)
        if res.returncode != 0 or not data.get("success"):
            raise RuntimeError(f"flwr supernode register failed for {name}:\n{res.stdout}")
        self.node_ids[name] = int(data["node-id"])
        return self.node_ids[name]

    def supernode_argv(self, name: str, node_config: str) -> list[str]:
        keys = self.secrets.hospitals[name]
        args = [
            "--root-certificates",
            str(keys["ca"]),
            "--superlink",
            self.public_address,
            "--auth-supernode-private-key",
            str(keys["private"]),
            "--node-config",
            node_config,
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
        ]
        if self.launcher == "flower":
            return [_bin("flower-supernode"), *args]
        if name in self.allow_lists:
            args += ["--allow-list", str(self.allow_lists[name])]
        return [sys.executable, "-m", "fedderm.accel", "supernode", *args]

    def node_config_values(self, i: int, name: str) -> dict:
        """Hospital ``name``'s node config (its own data folder, its client state under the work folder)."""
        return {
            "partition-id": i,
            "site": name,
            "dataset": "folder",
            "data-path": str(self.data[name]),
            "state-dir": str(self.workdir / "state" / name),
        }

    def node_config(self, i: int, name: str) -> str:
        """:meth:`node_config_values` as a SuperNode's ``--node-config``."""
        return run_config_arg(self.node_config_values(i, name))

    def start_supernodes(self, timeout: float = 90) -> None:
        procs = [
            self.spawn(f"supernode-{name}", self.supernode_argv(name, self.node_config(i, name)), home=name)
            for i, name in enumerate(self.hospitals)
        ]
        deadline = time.monotonic() + timeout
        # each SuperNode logs its "SuperNode ID" once the SuperLink activated it: read the logs (no
        # `flwr` process per poll), then ask the SuperLink once
        while not all("SuperNode ID:" in p.log.read_text(errors="replace") for p in procs):
            for name in self.hospitals:
                self._check_alive(f"supernode-{name}")
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        while (online := self.online()) != set(self.node_ids.values()):
            for name in self.hospitals:
                self._check_alive(f"supernode-{name}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SuperNodes online after {timeout:.0f} s: {sorted(online)}; registered: {self.node_ids}"
                )
            time.sleep(1)
        self.echo(
            f"nodes connected: {len(online)}/{len(self.hospitals)} online — "
            + ", ".join(f"{n} (node {self.node_ids[n]})" for n in self.hospitals)
        )

    def restart_supernode(self, name: str, allow_list: Path | None = None, timeout: float = 180) -> None:
        """Stop hospital ``name``'s SuperNode (and its SuperExec) and start it again, optionally
        with a new allow-list; waits until it is online again."""
        label = f"supernode-{name}"
        for proc in [p for p in self.procs if p.name == label]:
            _stop_groups([proc.popen], tags=[f"{self.tag}/{label}"])
            self.procs.remove(proc)
        if allow_list is not None:
            self.allow_lists[name] = Path(allow_list)
        i = self.hospitals.index(name)
        deadline = time.monotonic() + timeout
        # A SuperNode that crashed (no clean deactivation) counts as online at the SuperLink until
        # its heartbeat expires (2 x 30 s in Flower 1.41-1.42), and its activation is refused until
        # then: wait for that with one `flwr supernode list` every few seconds rather than starting
        # SuperNodes (each with its SuperExec and warm launcher) that are refused.
        since = time.monotonic()
        while self.node_ids.get(name) in self.online():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}'s old session was still online {timeout:.0f} s after its stop")
            time.sleep(4)
        waited = time.monotonic() - since
        tries = 0
        while True:
            tries += 1
            proc = self.spawn(label, self.supernode_argv(name, self.node_config(i, name)), home=name)
            # online: its "SuperNode ID" line
            while proc.popen.poll() is None and "SuperNode ID:" not in proc.log.read_text(errors="replace"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} was not online again {timeout:.0f} s after its restart")
                time.sleep(0.5)
            if proc.popen.poll() is None:
                break
            # refused all the same (its old session had not expired at the SuperLink yet): again
            log = proc.log.read_text(errors="replace")
            self.procs.remove(proc)
            if "Failed to activate" not in log or time.monotonic() > deadline:
                raise RuntimeError(f"{label} exited with code {proc.popen.returncode}:\n{log[-3000:]}")
            proc.log.rename(proc.log.with_suffix(f".refused-{tries}.log"))
            time.sleep(5)
        self.echo(
            f"{name}: restarted"
            + (f" with allow-list {allow_list}" if allow_list else "")
            + (f" (after {waited:.0f} s until its old session expired)" if waited >= 1 else "")
            + (f" (activation refused {tries - 1}x)" if tries > 1 else "")
        )

    def kill(self, name: str | None = None) -> None:
        """SIGKILL (a crash, no clean-up) process ``name`` and every process it started (its
        group, its descendants, whatever carries its tag); every process this object started
        when ``name`` is None."""
        procs = [p for p in self.procs if name is None or p.name == name]
        tags = [f"{self.tag}/" if name is None else f"{self.tag}/{name}"]
        _stop_groups([p.popen for p in procs], grace=0, tags=tags)
        for proc in procs:
            if proc in self.procs:  # a `flwr` call in another thread may have removed it already
                self.procs.remove(proc)

    def restart(self, database: str | None = None) -> None:
        """After :meth:`kill`: a new SuperLink (on a new port) and the SuperNodes started with
        the same node config (data, ``state-dir``), as a site would bring its machines back after
        a power cut.  ``database`` None: the SuperLink's file as before, whose registrations carry
        over (the hospitals do not register again, their node ids stay); a new file: the
        hospitals are registered again."""
        self.start_superlink(database=database)
        if database is not None:
            self.node_ids = {}
            for name in self.hospitals:
                self.register(name)
        self.start_supernodes()

    def online(self) -> set[int]:
        res = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        nodes = _json_tail(res.stdout).get("nodes", [])
        return {int(n["node-id"]) for n in nodes if n.get("status") == "online"}

    def start(self) -> None:
        self.prepare()
        self.start_superlink()
        for name in self.hospitals:
            self.register(name)
        self.echo(f"registered: {', '.join(f'{n} -> node {i}' for n, i in self.node_ids.items())}")
        self.start_supernodes()

    def try_outsider(self, timeout: float = 90) -> dict:
        """Start a SuperNode whose key was never registered; return how it ended."""
        proc = self.spawn(
            "supernode-outsider", self.supernode_argv(OUTSIDER, f'site="{OUTSIDER}"'), home=OUTSIDER
        )
        try:
            rc = proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # its SuperExec child outlives it for a while otherwise
            _stop_groups([proc.popen], tags=[f"{self.tag}/{proc.name}"])
        log = proc.log.read_text(errors="replace")
        reason = next((line.strip() for line in log.splitlines() if "Failed to activate" in line), "")
        refused = rc not in (None, 0) and bool(reason) and not (self.online() - set(self.node_ids.values()))
        return {"refused": refused, "returncode": rc, "reason": reason, "log": str(proc.log)}

    def run_config(self, method: str, run_config: dict, run_name: str | None = None) -> dict:
        """The run config :meth:`run` hands ``flwr run``: results under ``<workdir>/results``."""
        return {
            **BASE_RUN_CONFIG,
            "min-clients": len(self.hospitals),
            **run_config,
            "method": method,
            "output-dir": str(self.workdir / "results"),
            "run-name": run_name or method,
        }

    def run(
        self, method: str, run_config: dict, timeout: float = 900, run_name: str | None = None
    ) -> RunOutcome:
        """``flwr run`` the app for ``method`` and check its results folder."""
        config = self.run_config(method, run_config, run_name)
        name = config["run-name"]
        run_id, status, wall = self.flwr_run(self.app_dir, config, f"run-{name}", timeout)
        outcome = RunOutcome(method, run_id, status, self.workdir / "results" / name, wall)
        outcome.problems = check_results(outcome, len(self.hospitals), config["num-server-rounds"])
        if outcome.problems:
            outcome.problems.append(f"flwr run output: {self.workdir / 'logs' / f'run-{name}.log'}")
        return outcome

    def flwr_run(self, app: Path, run_config: dict, log_name: str, timeout: float = 900):
        """``flwr run <app> --stream``; returns (run id, Flower's final status, wall seconds).

        ``flwr run`` exits 0 even when the run failed, so the status comes from ``flwr ls``.
        """
        start = time.monotonic()
        res = self.flwr(
            "run",
            str(app),
            CONNECTION,
            "--stream",
            "--run-config",
            run_config_arg(run_config),
            timeout=timeout,
        )
        wall = time.monotonic() - start
        (self.workdir / "logs" / f"{log_name}.log").write_text(res.stdout)
        match = re.search(r"Successfully started run (\d+)", res.stdout)
        run_id = int(match.group(1)) if match else None
        status = "not started"
        if run_id is not None:
            runs = _json_tail(self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json").stdout)
            status = next(
                (r["status"] for r in runs.get("runs", []) if int(r["run-id"]) == run_id), "unknown"
            )
        return run_id, status, wall

    def _check_alive(self, name: str) -> None:
        for proc in self.procs:
            if proc.name == name and proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {proc.popen.returncode}:\n{tail}")


def check_results(outcome: RunOutcome, num_clients: int, rounds: int) -> list[str]:
    """What is wrong with a finished run (empty: nothing)."""
    problems = []
    if outcome.status != "finished:completed":
        problems.append(f"Flower reports run {outcome.run_id} as {outcome.status!r}")
    path = outcome.run_dir / "summary.json"
    if not path.exists():
        return problems + [f"no {path}"]
    summary = json.loads(path.read_text())
    outcome.summary = summary
    if summary.get("method") != outcome.method:
        problems.append(f"summary.json method is {summary.get('method')!r}, not {outcome.method!r}")
    per_client = (summary.get("final") or {}).get("per_client", {})  # None: the run failed
    if len(per_client) != num_clients:
        problems.append(f"final test metrics for {len(per_client)} clients, expected {num_clients}")
    for pid, metrics in per_client.items():
        ba = metrics.get("balanced_accuracy")
        if ba is None or not 0.0 <= ba <= 1.0 or metrics.get("num-examples", 0) <= 0:
            problems.append(f"client {pid}: bad final metrics {metrics}")
    done = sorted({r["round"] for r in summary.get("rounds", [])})
    if not done or max(done) < rounds:
        problems.append(f"rounds in summary.json: {done}, expected up to {rounds}")
    for name in ("model.pt", "model-best.pt", "rounds.csv"):
        if not (outcome.run_dir / name).exists():
            problems.append(f"missing {outcome.run_dir / name}")
    return problems


#: The environment variable every process a :class:`Loopback` starts carries, ``<tag>/<name>``;
#: their children inherit it.  It finds what left its parent's process group (Flower's SuperLink
#: starts its SuperExec, and so the ServerApp, in a session of their own) even once orphaned.
TAG_VAR = "FEDDERM_LOOPBACK"


def _has_tag(pid: int, tags: list[str]) -> bool:
    """Whether ``pid``'s environment has ``TAG_VAR`` equal to a tag, or under a tag ending in /."""
    value = procs.environ_value(pid, TAG_VAR)
    return value is not None and any(value == t or (t.endswith("/") and value.startswith(t)) for t in tags)


def _family(popens: list[subprocess.Popen], tags: list[str], known=()) -> dict[int, int]:
    """Every live process of ``popens``' process groups, descended from them or from ``known``,
    or carrying one of ``tags``: pid -> start time (the pair names a process even if its pid is
    reused later).  Found in /proc before any signal, while the parent links still hold."""
    table = procs.table()
    leaders = {p.pid for p in popens}
    roots = {pid for pid, st in table.items() if pid in leaders or st.pgrp in leaders or pid in known}
    roots |= {pid for pid in table if tags and pid not in roots and _has_tag(pid, tags)}
    found = roots | set(procs.descendants(roots, table))
    return {pid: table[pid].start for pid in found}


def _signal(family: dict[int, int], sig: int) -> dict[int, int]:
    """Send ``sig`` to every process of ``family`` still alive as itself; return those."""
    alive = {}
    for pid, started in family.items():
        st = procs.stat(pid)
        if st is None or st.state == "Z" or st.start != started:
            continue
        try:
            os.kill(pid, sig)
            alive[pid] = started
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def _stop_groups(popens: list[subprocess.Popen], grace: float = 15.0, tags: list[str] = ()) -> None:
    """Stop the processes ``popens`` (each started with a new session, so its group id is its
    PID), every process in their groups, every descendant (also one that started a session of
    its own) and every process carrying one of ``tags`` (:data:`TAG_VAR`, also an orphan):
    SIGTERM, then SIGKILL whatever is left after ``grace`` s (``grace=0``: SIGKILL at once).
    Only processes this module started, and their children, are signalled."""
    tags = list(tags)
    family = _family(popens, tags)  # before any signal: a dead parent's children are orphans

    def send(sig: int) -> dict[int, int]:
        nonlocal family
        for p in popens:
            p.poll()  # reap a leader that has exited
            try:
                os.killpg(p.pid, sig)  # also what forked since the last scan
            except (ProcessLookupError, PermissionError):
                pass
        family = {**family, **_family(popens, tags, known=family)}
        return _signal(family, sig)

    if grace > 0 and send(signal.SIGTERM):
        deadline = time.monotonic() + grace
        while send(0) and time.monotonic() < deadline:
            time.sleep(0.2)
    if send(signal.SIGKILL):
        deadline = time.monotonic() + 10  # SIGKILL ends a process once it leaves the kernel
        while send(0) and time.monotonic() < deadline:
            time.sleep(0.1)
    for p in popens:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _json_tail(text: str) -> dict:
    """The JSON object a ``flwr ... --format json`` printed (after any 'Using SuperLink' line)."""
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {}


def available_methods(wanted: list[str]) -> tuple[list[str], list[str]]:
    import registry

    return [m for m in wanted if m in registry.METHODS], [m for m in wanted if m not in registry.METHODS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hospitals", type=int, default=3, help="number of SuperNodes (default 3)")
    parser.add_argument(
        "--method",
        action="append",
        default=None,
        help=f"method to run; repeat for several (default: {', '.join(METHODS)})",
    )
    parser.add_argument("--rounds", type=int, default=2, help="num-server-rounds per run (default 2)")
    parser.add_argument(
        "--per-class", type=int, default=12, help="images per class per hospital (default 12)"
    )
    parser.add_argument("--workdir", default=None, help="work folder (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, results)")
    parser.add_argument(
        "--flower-superexec-polling",
        action="store_true",
        help="leave Flower's SuperExec poll interval at its 1 s default",
    )
    parser.add_argument(
        "--launcher",
        choices=("warm", "flower"),
        default="warm",
        help="warm: fedderm's pre-warmed ClientApp launcher (default); flower: Flower's "
        "own flower-supernode, one new process per message",
    )
    parser.add_argument(
        "--allow-list",
        default=None,
        help="a file of approved app sha256 hashes given to every hospital "
        "(default: no allow-list); `python -m fedderm.accel app-hash .` prints the hash",
    )
    parser.add_argument(
        "--no-proxy",
        action="store_true",
        help="no nginx in front: the SuperNodes connect to the SuperLink itself (every API open to "
        "them; to measure the proxy's cost)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (default 900)")
    args = parser.parse_args(argv)

    # SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C, so the finally below still stops everything
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    methods, missing = available_methods(args.method or list(METHODS))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedderm-loopback-"))
    failures: list[str] = []
    t0 = time.monotonic()
    hospitals = [f"hospital-{chr(ord('a') + i)}" for i in range(args.hospitals)]
    allow = {h: Path(args.allow_list).resolve() for h in hospitals} if args.allow_list else None
    with Loopback(
        workdir,
        args.hospitals,
        fast_superexec=not args.flower_superexec_polling,
        per_class=args.per_class,
        launcher=args.launcher,
        allow_lists=allow,
        proxy=not args.no_proxy,
    ) as fed:
        try:
            fed.start()
            if fed.proxy:
                admin = fed.try_outsider_admin()
                if admin["refused"]:
                    print(
                        "outsider with the CA certificate at the public address: flwr supernode register "
                        "and flwr ls refused (403 from the proxy)"
                    )
                else:
                    failures.append(f"the outsider's flwr commands were not refused: {admin}")
            outsider = fed.try_outsider()
            if outsider["refused"]:
                print(
                    f"unregistered SuperNode: refused (exit code {outsider['returncode']}: {outsider['reason']})"
                )
            else:
                failures.append(f"the unregistered SuperNode was not refused: {outsider}")
            for m in missing:
                print(f"{m}: not in this build's registry, skipped")
            for method in methods:
                cfg = {"num-server-rounds": args.rounds, **METHODS.get(method, {})}
                out = fed.run(method, cfg, timeout=args.timeout)
                print(describe_outcome(out))
                failures += [f"{method}: {p}" for p in out.problems]
        except Exception as err:  # noqa: BLE001 - reported, processes still stopped below
            failures.append(f"{type(err).__name__}: {err}")
        finally:
            fed.stop()
    print(f"stopped every process started ({time.monotonic() - t0:.0f} s in all)")
    if not args.keep and not failures and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"work folder {workdir} removed, with the results above (--keep keeps it)")
    else:
        print(f"work folder (kept): {workdir}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("loopback federation: all checks passed")
    return 0


def describe_outcome(out: RunOutcome) -> str:
    lines = [f"{out.method}: run {out.run_id} {out.status} in {out.wall_s:.0f} s (flwr run wall time)"]
    if out.summary:
        rounds = sorted({r["round"] for r in out.summary["rounds"] if r["round"] > 0})
        final = out.summary["final"]
        lines.append(f"  rounds done: {len(rounds)} · best round on val: {out.summary.get('best_round')}")
        lines.append(
            "  final test metrics (mean over clients): "
            + ", ".join(
                f"{k} {final[k]:.3f}"
                for k in ("balanced_accuracy", "accuracy", "auc")
                if final.get(k) is not None
            )
        )
        for pid, m in sorted(final["per_client"].items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"    client {pid}: balanced_accuracy {m['balanced_accuracy']:.3f} "
                f"on {m['num-examples']} test images"
            )
        lines.append(f"  results: {out.run_dir}")
    for p in out.problems:
        lines.append(f"  PROBLEM: {p}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
