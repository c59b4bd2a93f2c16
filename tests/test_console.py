"""sim.py's console (fedderm/console.py): Flower's console handler replaced through Python's
logging API, the same lines as Flower writes them, Flower's chatter dropped by where it comes from."""

from __future__ import annotations

import io
import logging
import os

import pytest
from flwr.common import log

from fedderm import console


@pytest.fixture
def flower_logger():
    """Flower's logger as Flower sets it up (its own console handler), whatever an earlier test in
    this process did to it (``sim.main`` sets fedderm's console up); restored afterwards."""
    from flwr.common.logger import console_handler

    logger = logging.getLogger(console.FLOWER_LOGGER)
    saved = logger.handlers[:]
    logger.handlers[:] = [h for h in saved if not isinstance(h, console.ConsoleHandler)]
    if console_handler not in logger.handlers:
        logger.addHandler(console_handler)
    yield logger
    logger.handlers[:] = saved


def _record(level: int, message: str, pathname: str) -> logging.LogRecord:
    return logging.LogRecord("flwr", level, pathname, 1, message, None, None)


@pytest.mark.parametrize("colour", [False, True])
def test_a_line_looks_as_flowers_console_writes_it(colour):
    from flwr.common.logger import ConsoleHandler as FlowerConsole

    for level in ("DEBUG", "INFO", "WARNING", "ERROR"):
        record = _record(getattr(logging, level), "round %d done", "x.py")
        record.args = (3,)
        ours = console.ConsoleHandler(io.StringIO(), colour).format(record)
        assert ours == FlowerConsole(colored=colour).format(record)
        assert ours.endswith("round 3 done") and ("\x1b[" in ours) == colour


def test_setup_replaces_flowers_handler_and_keeps_fedderms_lines(flower_logger, monkeypatch):
    from flwr.serverapp.strategy import FedAvg

    monkeypatch.setitem(os.environ, "NO_COLOR", "1")
    before = [h for h in flower_logger.handlers if isinstance(h, logging.StreamHandler)]
    assert before  # Flower's own console handler
    out = io.StringIO()
    console.setup(stream=out)
    console.setup(stream=out)  # twice: still one handler
    ours = [h for h in flower_logger.handlers if isinstance(h, logging.StreamHandler)]
    assert len(ours) == 1 and isinstance(ours[0], console.ConsoleHandler) and ours[0].level == before[0].level
    log(logging.INFO, "fedderm: round %d", 1)  # fedderm's own lines go through Flower's logger
    log(logging.WARNING, "client 2 left out")
    FedAvg(fraction_evaluate=0.0)  # Flower's strategy warns about a setting fedderm chose
    FedAvg().summary()  # Flower's INFO chatter
    flwr_dir = console._package_dir("flwr")
    for record in (
        _record(logging.ERROR, "An exception occurred !! boom", os.path.join(flwr_dir, "simulation", "x.py")),
        _record(logging.ERROR, "ClientAppException", os.path.join(flwr_dir, "server", "superlink", "v.py")),
    ):
        flower_logger.handle(record)
    flower_logger.handle(
        _record(logging.ERROR, "a Flower error elsewhere", os.path.join(flwr_dir, "cli", "x.py"))
    )
    flower_logger.handle(_record(logging.ERROR, "error: client 1: bad file", __file__))
    assert out.getvalue().splitlines() == [
        "INFO :      fedderm: round 1",
        "WARNING :   client 2 left out",
        "ERROR :     a Flower error elsewhere",
        "ERROR :     error: client 1: bad file",
    ]


def test_verbose_leaves_flowers_handler(flower_logger):
    before = flower_logger.handlers[:]
    console.setup(verbose=True, stream=io.StringIO())
    assert flower_logger.handlers == before


def test_setup_before_flower_is_imported_leaves_one_handler(tmp_path):
    """sim.py sets the console up before it imports Flower: Flower's own handler, added when Flower
    is imported, must not come back beside fedderm's (every line twice)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, logging\n"
        "from fedderm import console\n"
        "console.setup(stream=sys.stdout)\n"
        "from flwr.common import log\n"
        "log(logging.INFO, 'one line')\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env)
    assert out.returncode == 0, out.stderr
    assert (out.stdout + out.stderr).splitlines() == ["INFO :      one line"]
