"""The ClientApps of ``fedderm-superexec``, forked by the standard library's fork server.

Flower's SuperExec runs threads, and a process forked from a multi-threaded one can inherit a lock
that no thread in it will release (the hazard CPython warns about).  So the SuperExec never forks:
at its start, before Flower starts anything, it starts :mod:`multiprocessing`'s fork server
(:func:`start_fork_server`), a fresh single-threaded interpreter that imports the libraries every
ClientApp needs (:data:`LIBRARIES`) once.  Each ClientApp task is a child of that server
(:class:`ForkExecutor`): the allow-list guard, then Flower's ``run_clientapp`` with the task's token.
No app code is ever imported in the server: each child imports the (approved) app bundle itself
(docs/deploy-internals.md, "The fork server").
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import forkserver as _stdlib_forkserver

from fedderm.accel.allow import guard_install

_log = logging.getLogger("flwr")
#: imported once in the fork server: what every ClientApp imports (no torch op runs at import)
LIBRARIES = (
    "numpy",
    "torch",
    "torchvision",
    "torchvision.transforms.v2",
    "timm",
    "sklearn.metrics",
    "PIL.Image",
    "flwr.clientapp",
    "flwr.app",
    "flwr.supernode.runtime.run_clientapp",
)
#: how long the tasks have between SIGTERM and SIGKILL when the SuperExec closes (seconds)
STOP_GRACE = 5.0


def fork_context(preload: tuple[str, ...] = LIBRARIES):
    """The ``forkserver`` multiprocessing context, its server importing ``preload`` when it starts
    (a module that does not import is skipped by the server)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return context


def start_fork_server(preload: tuple[str, ...] = LIBRARIES):
    """Start the fork server now (a fresh interpreter, not a fork), before Flower starts any
    thread here; its context.  It exits when this process and every task it forked have ended."""
    context = fork_context(preload)
    _stdlib_forkserver.ensure_running()
    return context


def fedderm_modules() -> list[str]:
    """The launcher's own copy of fedderm (never run as app code), the accelerator excepted."""
    return [m for m in sys.modules if m.partition(".")[0] == "fedderm" and not m.startswith("fedderm.accel")]


def run_task(task: dict, allowed: set[str] | None, source: str) -> None:
    """In the forked child: the allow-list guard, then Flower's ``run_clientapp`` with the task's token.

    The app bundle brings its own fedderm: the launcher's copy is dropped first."""
    for name in fedderm_modules():
        sys.modules.pop(name, None)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Flower's parent monitor raises SIGINT to stop it
        signal.signal(sig, signal.SIG_DFL)
    _end_when_gone(task["parent_pid"])
    guard_install(allowed, source)
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    try:
        run_clientapp(
            runtime_api_address=task["runtime_api_address"],
            token=task["token"],
            insecure=task["insecure"],
            certificates=validate_and_resolve_root_certificates(
                task["root_certificates_path"], task["insecure"]
            ),
            parent_pid=task["parent_pid"],  # the child stops when the SuperExec ends
            runtime_dependency_install=False,
        )
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # done: no wait for threads the task's libraries left running


def _end_when_gone(pid: int, grace: float = STOP_GRACE) -> None:
    """Once the SuperExec ``pid`` is gone, give Flower's own stop (its parent monitor, which then
    pushes the task's output) ``grace`` seconds, then end this task (a thread in the task)."""
    import psutil

    def watch() -> None:
        while psutil.pid_exists(pid):
            time.sleep(0.5)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="fedderm-superexec-watch", daemon=True).start()


class ForkExecutor:
    """Flower's ``Executor`` protocol: one ClientApp task = one child of the fork server.

    Other task types go to Flower's own :class:`SubprocessExecutor`."""

    def __init__(self, allowed: set[str] | None, source: str, preload: tuple[str, ...] = LIBRARIES):
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.allowed, self.source = allowed, source
        self.context = fork_context(preload)
        self.fallback = SubprocessExecutor()
        self.tasks: list[multiprocessing.Process] = []
        atexit.register(self.stop_tasks)  # before multiprocessing's own exit handler joins them

    def get_eligible_capacity(self, supported_task_types, **kwargs):
        return self.fallback.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, *args, **kwargs) -> None:
        return None

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.fallback.launch(spec)
        task = {
            "runtime_api_address": spec.runtime_api_address,
            "token": spec.token,
            "insecure": spec.insecure,
            "root_certificates_path": spec.root_certificates_path,
            "parent_pid": spec.parent_pid or os.getpid(),
        }
        process = self.context.Process(
            target=run_task, args=(task, self.allowed, self.source), name=f"clientapp-{spec.task_id}"
        )
        try:
            process.start()
        except (OSError, EOFError, ValueError) as err:
            return LaunchResult.failed(f"fedderm fork server: {err!r}")
        self.reconcile()
        self.tasks.append(process)
        _log.debug("fedderm launcher: task %s forked as pid %d", spec.task_id, process.pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Forget the finished tasks (the fork server reaps them)."""
        self.tasks = [p for p in self.tasks if p.is_alive()]

    def stop_tasks(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM every live task, SIGKILL what is left after ``grace`` seconds."""
        for process in self.tasks:
            if process.is_alive():
                process.terminate()
        for process in self.tasks:
            process.join(grace)
            if process.is_alive():
                process.kill()
                process.join()
        self.tasks = []

    def close(self) -> None:
        self.stop_tasks()
        self.fallback.close()


def _probe(reply) -> None:
    """In a probe child: who forked it, and whether the libraries were already imported."""
    import psutil

    parent = psutil.Process(os.getppid())
    reply.send({"parent": parent.pid, "cmdline": " ".join(parent.cmdline()), "warm": "torch" in sys.modules})
    reply.close()


def self_test_fork_server(preload: tuple[str, ...] = LIBRARIES) -> str | None:
    """A task runs in a warm process forked by the fork server: a probe child must have the
    server (not this process) as its parent and find torch already imported.  Returns what
    failed, or ``None``."""
    try:
        context = start_fork_server(preload)
        ours, theirs = context.Pipe(duplex=False)
        child = context.Process(target=_probe, args=(theirs,), name="fedderm-fork-probe")
        child.start()
        theirs.close()
        reply = ours.recv() if ours.poll(60) else {}
        child.join(10)
    except (OSError, EOFError, ValueError, RuntimeError) as err:
        return f"fork server: {err!r}"
    if not reply:
        return "fork server: the probe task did not answer within 60 s"
    if reply["parent"] == os.getpid() or "multiprocessing.forkserver" not in reply["cmdline"]:
        return f"fork server: the task was forked by pid {reply['parent']} ({reply['cmdline'][:80]})"
    if "torch" in preload and not reply["warm"]:
        return "fork server: the task did not find the libraries imported in the server"
    return None
