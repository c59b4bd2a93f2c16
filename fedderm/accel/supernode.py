"""A hospital's ``fedderm-supernode`` and the ``fedderm-superexec`` it starts: Flower's own
processes with the waits of :mod:`fedderm.accel.waits`, the allow-list of
:mod:`fedderm.accel.allow` and the ClientApps forked by :mod:`fedderm.accel.forkserver`."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

from fedderm.accel import waits
from fedderm.accel.allow import allow_list_from, pop_option, read_allow_list
from fedderm.accel.forkserver import ForkExecutor, start_fork_server
from fedderm.accel.waits import (
    ClampedTime,
    WakeableTime,
    fast_object_pulls,
    poll_interval,
    waking_object_pull,
)

_log = logging.getLogger("flwr")


def superexec_main(argv: list[str]) -> None:
    """``fedderm-superexec``: ``flower-superexec`` arguments plus ``--allow-list FILE``.

    The fork server is started first (if the self-test has not yet), before Flower starts any
    thread in this process; this process itself never forks."""
    start_fork_server()
    argv = list(argv)
    allowed, source = allow_list_from(argv)
    wake_fd = pop_option(argv, "--wake-fd")
    interval = poll_interval()
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(max(interval, 0.01)))
    fast_object_pulls(interval)
    # the packages re-export functions under the modules' names: import the modules themselves
    cli = importlib.import_module("flwr.supercore.cli.flower_superexec")
    rs = importlib.import_module("flwr.supercore.superexec.run_superexec")

    rs.get_executor = lambda *a, **k: ForkExecutor(allowed, source)
    if wake_fd is not None:
        rs.time = WakeableTime(int(wake_fd))
    if allowed is not None:
        _log.warning("fedderm launcher: only app bundles on %s (%d hashes) will run", source, len(allowed))
    sys.argv = ["fedderm-superexec", *argv]
    cli.flower_superexec()


class SuperExecPopen:
    """``subprocess`` for the SuperNode module: its ``flower-superexec`` becomes ours."""

    def __init__(self, extra: list[str]):
        import subprocess

        self._subprocess, self.extra = subprocess, extra

    def Popen(self, command, *args, **kwargs):  # noqa: N802 - mirrors subprocess.Popen
        if not command or command[0] != "flower-superexec":
            return self._subprocess.Popen(command, *args, **kwargs)
        # a pipe on which the SuperNode wakes its SuperExec when a task waits (WakeableTime)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        command = [
            sys.executable, "-m", "fedderm.accel", "superexec", *command[1:], *self.extra,
            "--wake-fd", str(read_fd),
        ]  # fmt: skip
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), read_fd)
        try:
            popen = self._subprocess.Popen(command, *args, **kwargs)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        waits.WAKE_FDS.append(write_fd)
        return popen

    def __getattr__(self, name):
        return getattr(self._subprocess, name)


def isolation(argv: list[str]) -> str:
    """The SuperNode's ``--isolation`` (argparse's rule: the last one given; Flower's default
    ``subprocess``)."""
    mode = "subprocess"
    for i, token in enumerate(argv):
        if token == "--isolation" and i + 1 < len(argv):
            mode = argv[i + 1]
        elif token.startswith("--isolation="):
            mode = token.split("=", 1)[1]
    return mode


def refuse_unenforceable_allow_list(argv: list[str], allow_list: str | None) -> None:
    """Stop a SuperNode asked for an allow-list it cannot enforce, with one line naming why.

    The allow-list is checked by the SuperExec this SuperNode starts (``--isolation subprocess``,
    Flower's default).  With ``--isolation process`` the SuperNode starts none: whatever SuperExec
    the hospital runs on its own launches the ClientApps, and this process never sees them."""
    allow_list = allow_list or os.environ.get("FEDDERM_ALLOW_LIST", "")
    if allow_list and isolation(argv) == "process":
        raise SystemExit(
            f"fedderm-supernode: --isolation process starts no SuperExec here, so the allow-list "
            f"{allow_list} cannot be enforced by this SuperNode; give it to the SuperExec you start "
            f"(fedderm-superexec --allow-list {allow_list} --runtime-api-address ...), or run this "
            "SuperNode with --isolation subprocess (docs/deploy.md#code-approval-the-hospitals-allow-list)"
        )


def supernode_main(argv: list[str]) -> None:
    """``fedderm-supernode``: ``flower-supernode`` arguments plus ``--allow-list FILE``."""
    argv = list(argv)
    allow_list = pop_option(argv, "--allow-list")
    refuse_unenforceable_allow_list(argv, allow_list)
    extra = []
    if allow_list:
        read_allow_list(allow_list)  # fail at start, not at the first message
        extra = ["--allow-list", str(Path(allow_list).expanduser().resolve())]
    interval = poll_interval()
    fast_object_pulls(interval)
    sci = importlib.import_module("flwr.supernode.start_client_internal")
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")

    sci.time = ClampedTime(interval)
    sci.subprocess = SuperExecPopen(extra)
    sci.pull_objects = waking_object_pull(sci.pull_objects)
    sys.argv = ["fedderm-supernode", *argv]
    cli.flower_supernode()
