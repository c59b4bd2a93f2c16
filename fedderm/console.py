"""The console of ``sim.py``: no colour codes off a terminal, Flower's and Ray's per-round chatter
filtered out (kept under ``--verbose``), Ctrl-C / SIGTERM stop the run at once.

fedderm's own lines (clients and their splits, one line per round, the final table, the results
folder) stay; the lines below are Flower's internals, which repeat every round.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import warnings
from collections.abc import Callable

from . import procs

#: Flower's logger (``flwr.common.log`` writes to it; fedderm's own lines go through it too)
FLOWER_LOGGER = "flwr"
#: ``extra`` of a line of fedderm's that repeats Flower's per-round chatter (its strategies'
#: "aggregate_train: Received ..."): the console leaves it out as it leaves Flower's out
CHATTER = {"fedderm_chatter": True}
#: ANSI colours of the level names, as Flower's console shows them
COLOURS = {"DEBUG": "94", "INFO": "92", "WARNING": "93", "ERROR": "91", "CRITICAL": "95"}


def _package_dir(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec and spec.origin else "\0"


class _Quiet(logging.Filter):
    """Keep fedderm's own lines; drop Flower's by where they come from, not by their text:
    its INFO chatter (banners, sampling, "Received n results", the runtime's start-up lines, and
    fedderm's lines that repeat it: :data:`CHATTER`), its
    strategies' warnings about the settings fedderm chose (``fraction_evaluate`` 0), and its
    simulation runtime's ERROR lines about a ClientApp that raised (the reason comes back in the
    client's reply and fedderm reports it in one line naming the client; a runtime failure is
    raised and ``sim.py`` reports it in one line)."""

    def __init__(self):
        super().__init__()
        flwr = _package_dir("flwr")
        self.flower = flwr
        self.strategies = os.path.join(flwr, "serverapp", "strategy") + os.sep
        self.runtime = (os.path.join(flwr, "simulation") + os.sep, os.path.join(flwr, "server") + os.sep)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "fedderm_chatter", False):
            return False
        path = record.pathname
        if not path.startswith(self.flower):
            return True
        if record.levelno >= logging.ERROR:
            return not path.startswith(self.runtime)
        return record.levelno >= logging.WARNING and not path.startswith(self.strategies)


def _config_error(err: BaseException | None) -> BaseException | None:
    """The run-config mistake (:class:`fedderm.config.ConfigError`) behind ``err``, or None."""
    from .config import ConfigError

    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, ConfigError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class _OneLineConfigErrors(logging.Filter):
    """Flower logs an exception that ends the ServerApp with its traceback (``Simulation raised an
    exception``, ``ServerApp raised an exception``) before its exit code; for a run-config mistake
    the traceback gives way to fedderm's message, which names the key: one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        mistake = _config_error(record.exc_info[1] if record.exc_info else None)
        if mistake is not None:
            record.msg, record.args = f"{record.getMessage()}: {mistake}", None
            record.exc_info = record.exc_text = None
        return True


def one_line_config_errors() -> None:
    """Install :class:`_OneLineConfigErrors` on Flower's logger (once per process)."""
    logger = logging.getLogger(FLOWER_LOGGER)
    if not any(isinstance(f, _OneLineConfigErrors) for f in logger.filters):
        logger.addFilter(_OneLineConfigErrors())


class ConsoleHandler(logging.StreamHandler):
    """Flower's console line (``INFO :      message``), coloured only when ``colour``."""

    def __init__(self, stream, colour: bool):
        super().__init__(stream)
        self.colour = colour

    def format(self, record: logging.LogRecord) -> str:
        on, off = (f"\x1b[{COLOURS.get(record.levelname, '0')}m", "\x1b[0m") if self.colour else ("", "")
        separator = " " * (8 - len(record.levelname))
        return logging.Formatter(f"{on}%(levelname)s {off}: {separator} %(message)s").format(record)


def setup(verbose: bool = False, stream=None) -> None:
    """Without ``verbose``: Flower's console handler (a stream handler on its logger) gives way to
    :class:`ConsoleHandler` on ``stream`` (default stderr), at the same level, coloured only on a
    terminal (``NO_COLOR`` honoured), with :class:`_Quiet`; Ray's warnings and its forwarded
    worker output are dropped (the clients' errors come back in their replies).  With
    ``verbose`` Flower's own handler stays, as Flower configures it."""
    if verbose:
        return
    stream = sys.stderr if stream is None else stream
    import flwr.common  # noqa: F401 - Flower adds its console handler to its logger when imported

    logger = logging.getLogger(FLOWER_LOGGER)
    if not any(isinstance(h, ConsoleHandler) for h in logger.handlers):
        consoles = [
            h
            for h in logger.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        ]
        mine = ConsoleHandler(
            stream, bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ
        )
        mine.setLevel(min((h.level for h in consoles), default=logging.INFO))
        mine.addFilter(_Quiet())
        for handler in consoles:
            logger.removeHandler(handler)
        logger.addHandler(mine)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    logging.getLogger("ray").setLevel(logging.ERROR)


#: An environment variable ``sim.py`` sets in its own environment before Ray starts
#: (:func:`tag_processes`): every process started under it inherits it, Ray's workers too, which
#: outlive their parent (the raylet) by 10-30 s once Ray shuts down, no longer its descendants.
PROCESS_TAG = "FEDDERM_SIM_PROCESS"


def tag_processes() -> None:
    """Mark this process's environment with its own :data:`PROCESS_TAG` (pid and a random part),
    which the processes it starts from now on inherit."""
    os.environ[PROCESS_TAG] = f"{os.getpid()}.{secrets.token_hex(4)}"


def _ours() -> list[int]:
    """The processes this one started: its descendants and, with its own tag set
    (:func:`tag_processes`), every live process of this user carrying the tag."""
    pids = procs.descendants(os.getpid())
    tag = os.environ.get(PROCESS_TAG, "")
    if tag.startswith(f"{os.getpid()}."):
        pids += [pid for pid in procs.tagged(PROCESS_TAG, tag) if pid not in pids]
    return pids


def stop_children(grace: float = 0.0) -> None:
    """Stop every process this one started (Ray's GCS, raylet, agents, workers), so that none
    outlives the run: SIGKILL at once, or with ``grace`` seconds SIGTERM first (a finished run:
    Ray's workers end cleanly)."""
    pids = _ours()
    if grace > 0:
        procs.stop_tree(pids, grace)
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def stop_on_signals(report: Callable[[int], None]) -> None:
    """SIGINT and SIGTERM: call ``report(signum)`` (record the interruption, say how to resume),
    then leave at once with 128 + signum (130, 143).  The per-round checkpoints are written
    atomically, so the newest one is intact.  ``sim.py`` runs Flower's simulation runtime off the
    main thread (:func:`sim.off_main_thread`), so that ``ray.init`` does not replace the SIGTERM
    handler with its own."""

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
