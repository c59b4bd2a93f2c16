"""The console of ``sim.py``: no colour codes off a terminal, Flower's and Ray's per-round chatter
filtered out (kept under ``--verbose``), Ctrl-C / SIGTERM stop the run at once.

fedderm's own lines (clients and their splits, one line per round, the final table, the results
folder) stay; the lines below are Flower's internals, which repeat every round.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable

from . import procs

#: Flower log lines that repeat every round or say nothing a user acts on (dropped without --verbose)
NOISE = re.compile(
    "|".join(
        [
            r"configure_(train|evaluate): ",  # "Sampled 2 nodes (out of 2)"
            r"aggregate_(train|evaluate): ",  # "Received 2 results and 0 failures"
            r"fraction_(train|evaluate)",  # FedAvg's "fraction_evaluate ... ignored" warnings
            r"^\[ROUND \d+",  # Flower's round banner
            r"^\s*$",  # blank lines around the banners
            r"Starting (Flower )?(ServerApp|Simulation|FedAvg strategy)",
            r"Run finished|Summary of|History \(|Manually terminating|Stopping Simulation",
            r"Number of rounds|ArrayRecord \(|Fraction: |Initial|└──|├──|│",
            r"Asking Ray|Initialising: |Backend config|Flower VCE|Using default",
        ]
    )
)


#: Flower's ERROR lines about a ClientApp that raised (with Ray's traceback): the reason comes back
#: to the server in the client's reply, and fedderm reports it in one line naming the client
CLIENT_TRACEBACK = re.compile(
    r"Traceback \(most recent call last\)|ray::ClientAppActor|processing a message by "
    r"RayBackend|ClientAppException|An exception occurred !!|An error was encountered"
)


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            return not CLIENT_TRACEBACK.search(message)
        return not NOISE.search(message)


def setup(verbose: bool = False, stream=None) -> None:
    """Colour only on a terminal; without ``verbose`` drop Flower's per-round lines, Ray's
    warnings and its forwarded worker output (the clients' errors come back in their replies)."""
    from flwr.common.logger import update_console_handler

    stream = sys.stderr if stream is None else stream
    update_console_handler(
        colored=bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ
    )
    if verbose:
        return
    from flwr.common.logger import console_handler

    if not any(isinstance(f, _Quiet) for f in console_handler.filters):
        console_handler.addFilter(_Quiet())
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    logging.getLogger("ray").setLevel(logging.ERROR)


def stop_children() -> None:
    """SIGKILL every process this one started (Ray's GCS, raylet, agents, workers), so that none
    outlives an interrupted run."""
    for pid in procs.descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def stop_on_signals(report: Callable[[int], None]) -> None:
    """SIGINT and SIGTERM: call ``report(signum)`` (record the interruption, say how to resume),
    then leave at once with 128 + signum (130, 143).  The per-round checkpoints are written
    atomically, so the newest one is intact.  :func:`keep_ray_off_signals` keeps Ray's own SIGTERM
    handler (installed by ``ray.init``, it exits with Ray's dumps) from replacing this one."""

    def handler(signum, _frame):
        signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C does not interrupt the report
        try:
            report(signum)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            stop_children()
            os._exit(128 + signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def keep_ray_off_signals() -> None:
    """Keep Ray's own SIGTERM handler (installed by ``ray.init``) from replacing the one of
    :func:`stop_on_signals`; called just before Ray starts, so that checks before it need no Ray."""
    try:
        import ray._private.utils as ray_utils
    except ImportError:  # pragma: no cover - flwr[simulation] brings Ray
        return
    ray_utils.set_sigterm_handler = lambda _handler: None
