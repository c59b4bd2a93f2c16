"""The fork server of ``fedderm-superexec``: a single-threaded process that forks the ClientApps.

Flower's SuperExec runs threads, and a process forked from a multi-threaded one can inherit a lock
that no thread in it will release (the hazard CPython warns about).  So the SuperExec never forks:
at its start, before Flower starts anything, it starts this server as a fresh interpreter
(:class:`ForkServer`), connected by a socket pair.  The server runs no thread, imports the approved
app once (:class:`WarmApp`), forks one child per ClientApp task (the allow-list guard, then
Flower's ``run_clientapp`` with the task's token), reaps them, and stops them and exits when the
SuperExec's end of the socket closes (docs/deploy-internals.md, "The fork server").

``multiprocessing``'s forkserver imports a fixed list when it starts and then only forks; the app
bundle to keep imported is known only when its first task arrives (and changes when a hospital
approves a new one), so this server imports between forks.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from fedderm.accel.allow import guard_install, installed_marker
from fedderm.accel.warm import WarmApp, drop_modules, fedderm_modules, prewarm

_log = logging.getLogger("flwr")
#: how often the server reaps finished children while no request comes (seconds)
REAP_INTERVAL = 0.5
#: how long the children have between SIGTERM and SIGKILL when the server stops (seconds)
STOP_GRACE = 5.0


class TaskForker:
    """The fork server's state: the app imported once, bundles kept cold, the live children."""

    def __init__(self):
        self.warm = WarmApp()
        self.cold: set[str] = set()  # bundles whose import cannot be kept in the server
        self.children: set[int] = set()

    def warm_up(self, digest: str | None, allowed: set[str] | None) -> None:
        """Import the app of bundle ``digest`` here if it is approved and installed."""
        if not digest or digest == self.warm.digest or digest in self.cold:
            return
        if allowed is not None and digest not in allowed:
            return  # the child refuses it; nothing of it is imported here
        marker = installed_marker(digest)
        folder = Path(marker.read_text()) if marker.is_file() else None
        if folder is None or not folder.is_dir():
            return  # the first child installs it (Flower verifies it) and writes the marker
        if not self.warm.load(digest, folder):
            self.cold.add(digest)

    def fork(self, run, conn: Connection | None) -> dict:
        """Fork a child that calls ``run()`` and exits with what it returns; the child's pid."""
        threads = threading.active_count()
        if threads != 1:
            raise RuntimeError(f"the fork server runs {threads} Python threads: it does not fork")
        pid = os.fork()
        if pid == 0:  # the child never returns
            code = 1
            try:
                if conn is not None:
                    conn.close()  # the SuperExec's requests are the server's
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                code = run() or 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - a child must never return into the server's loop
                _log.exception("fedderm launcher: task child failed")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.children.add(pid)
        return {"pid": pid, "python_threads": threads, "server": os.getpid()}

    def launch(self, request: dict, conn: Connection | None = None) -> dict:
        """Fork the ClientApp of ``request["spec"]`` (Flower's ``ExecutionSpec``)."""
        spec, allowed = request["spec"], request["allowed"]
        self.warm_up(spec.fab_hash, allowed)
        superexec = spec.parent_pid or os.getppid()  # the child stops when the SuperExec ends
        return self.fork(lambda: self._run_task(spec, allowed, request["source"], superexec), conn)

    def _run_task(self, spec, allowed: set[str] | None, source: str, superexec: int) -> None:
        """In the child: the allow-list guard, then Flower's ``run_clientapp`` with the task's token."""
        # the app bundle brings its own fedderm: never run the launcher's copy as app code; the
        # app the server imported is kept only for its own bundle (checked again on the bytes)
        if spec.fab_hash != self.warm.digest:
            self.warm.drop()
        drop_modules(fedderm_modules() if self.warm.digest is None else [])
        guard_install(allowed, source, self.warm)
        from flwr.supercore.tls import validate_and_resolve_root_certificates
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        run_clientapp(
            runtime_api_address=spec.runtime_api_address,
            token=spec.token,
            insecure=spec.insecure,
            certificates=validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
            parent_pid=superexec,
            runtime_dependency_install=False,
        )

    def probe(self, request: dict, conn: Connection | None = None) -> dict:
        """Import the probe app at ``folder``, fork a child that exits 0 if it finds the app's
        ``module`` imported, and wait for it (``exit``)."""
        if not self.warm.load("self-test", Path(request["folder"])):
            raise RuntimeError(f"the probe app in {request['folder']} could not be imported")
        try:
            reply = self.fork(lambda: 0 if request["module"] in sys.modules else 3, conn)
            self.children.discard(reply["pid"])
            reply["exit"] = os.waitstatus_to_exitcode(os.waitpid(reply["pid"], 0)[1])
        finally:
            self.warm.drop()
        return reply

    def reap(self) -> None:
        """Wait for every finished child (no zombies)."""
        for pid in list(self.children):
            try:
                done = os.waitpid(pid, os.WNOHANG)[0]
            except ChildProcessError:
                done = pid
            if done:
                self.children.discard(pid)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM every live child, then SIGKILL what is left after ``grace`` seconds."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.children:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while self.children and time.monotonic() < deadline:
                self.reap()
                time.sleep(0.05)


def serve(fd: int, preload: bool = True) -> None:
    """The server's loop on socket ``fd`` until the SuperExec's end closes; ``preload``: import
    what every ClientApp needs first (:func:`prewarm`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the SuperExec stops it (end of the socket)
    conn = Connection(fd)
    if preload:
        prewarm()
    forker = TaskForker()
    handlers = {"launch": forker.launch, "probe": forker.probe}
    try:
        while True:
            forker.reap()
            if not conn.poll(REAP_INTERVAL):
                continue
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return
            try:
                reply = handlers[request["op"]](request, conn)
            except Exception as err:  # noqa: BLE001 - the SuperExec reports it as a failed launch
                reply = {"error": f"{type(err).__name__}: {err}"}
            conn.send(reply)
    finally:
        forker.stop()


class ForkServer:
    """The SuperExec's handle on its fork server: one request at a time, restarted if it ended."""

    def __init__(self, preload: bool = True):
        self.preload = preload
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None

    def start(self) -> ForkServer:
        ours, theirs = socket.socketpair()
        code = "import sys\nfrom fedderm.accel.forkserver import serve\nserve(int(sys.argv[1]), sys.argv[2] == '1')"
        try:
            command = [sys.executable, "-c", code, str(theirs.fileno()), str(int(self.preload))]
            self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        return self

    def alive(self) -> bool:
        """Whether the server runs (a server that ended is waited for here)."""
        return self.process is not None and self.process.poll() is None

    def ask(self, request: dict) -> dict:
        """The server's reply to ``request`` (raises ``RuntimeError`` with the server's error)."""
        if not self.alive():
            if self.process is not None:
                _log.warning(
                    "fedderm launcher: the fork server ended (%s); restarting it", self.process.returncode
                )
                self.close()
            self.start()
        self.conn.send(request)
        reply = self.conn.recv()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        """Close the socket (the server stops its children and exits) and wait for the server."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is not None:
            try:
                self.process.wait(timeout=2 * STOP_GRACE + 1)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


_SHARED: ForkServer | None = None


def shared_server() -> ForkServer:
    """This SuperExec's fork server (started by the self-test, else at the SuperExec's start)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = ForkServer().start()
    return _SHARED


class ForkExecutor:
    """Flower's ``Executor`` protocol: one ClientApp task = one child of the fork server.

    Other task types go to Flower's own :class:`SubprocessExecutor`."""

    def __init__(self, allowed: set[str] | None, source: str, server: ForkServer | None = None):
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.allowed, self.source = allowed, source
        self.server = server if server is not None else shared_server()
        self.fallback = SubprocessExecutor()
        self.last_fork: dict = {}  # the server's reply to the last launch

    def get_eligible_capacity(self, supported_task_types, **kwargs):
        return self.fallback.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, *args, **kwargs) -> None:
        return None

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.fallback.launch(spec)
        try:
            request = {"op": "launch", "spec": spec, "allowed": self.allowed, "source": self.source}
            self.last_fork = self.server.ask(request)
        except (OSError, EOFError, RuntimeError) as err:
            return LaunchResult.failed(f"fedderm fork server: {err}")
        _log.debug("fedderm launcher: task %s forked as pid %d", spec.task_id, self.last_fork["pid"])
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        self.server.alive()  # the server reaps the tasks; a server that ended is waited for here

    def close(self) -> None:
        self.server.close()
        self.fallback.close()


def self_test_fork_server() -> str | None:
    """A task runs in a warm process forked by a single-threaded server: the server imports a
    probe app and forks a child that must find it imported, from a server other than this process
    with one Python thread.  Returns what failed (the server is then stopped), or ``None``."""
    module = "fedderm_fork_server_probe"
    with tempfile.TemporaryDirectory(prefix="fedderm-probe-") as folder:
        (Path(folder) / f"{module}.py").write_text("app = 'warm'\n")
        (Path(folder) / "pyproject.toml").write_text(
            f'[tool.flwr.app.components]\nclientapp = "{module}:app"\n'
        )
        try:
            reply = shared_server().ask({"op": "probe", "folder": folder, "module": module})
        except (OSError, EOFError, RuntimeError) as err:
            reply = {"error": str(err)}
    if "error" in reply:
        failure = f"fork server: {reply['error']}"
    elif reply["server"] == os.getpid() or reply["python_threads"] != 1:
        failure = (
            f"fork server: forked by pid {reply['server']} with {reply['python_threads']} Python threads"
        )
    elif reply["exit"] != 0:
        failure = f"fork server: the task did not find the app imported in the server (exit {reply['exit']})"
    else:
        return None
    shared_server().close()  # the SuperExec runs stock Flower: no fork server
    return failure
