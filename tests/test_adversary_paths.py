"""An adversary's moves on paths, files and threads, each refused: a server that names where a
hospital writes, a client that names where the server writes, a power cut that leaves a damaged
checkpoint, a pickle that would run code placed where fedderm loads files, a failed run that
leaves a thread behind; and the run folder's size on disk."""

from __future__ import annotations

import json
import threading
import time

import pytest

import strategies.common as common
from bench.loop_grid import TINY_RUN, run_app


class Killed(Exception):
    """Stands for the server's machine losing power."""


# -- a failed run leaves no thread ------------------------------------------------------------
def test_a_failed_run_leaves_no_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def fail(*args, **kwargs):
        raise Killed("the disk is full")

    monkeypatch.setattr(common, "save_checkpoint", fail)
    before = set(threading.enumerate())
    with pytest.raises(Killed):
        run_app(
            {
                **TINY_RUN,
                "tensorboard": True,
                "cache-dir": str(tmp_path / "c"),
                "output-dir": str(tmp_path / "o"),
            }
        )
    deadline = time.monotonic() + 5
    while (
        left := [t for t in threading.enumerate() if t not in before and t.is_alive()]
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, [t.name for t in left]
    (run_dir,) = (tmp_path / "o").iterdir()
    assert list(run_dir.glob("events.out.tfevents.*"))  # it did write events
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
