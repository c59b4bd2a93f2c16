"""``sim.py`` ends cleanly: a failure of the simulation runtime (Ray cannot start) ends it at once,
non-zero, with the first error in summary.json, which no later signal replaces."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import server_app
import sim
from fedderm.results import RunRecorder

ROOT = Path(__file__).resolve().parents[1]

#: ``python sim.py ...`` with Ray's start failing as it does on a loaded machine
DRIVER = """
import runpy, sys, time
from flwr.server.superlink.fleet.vce.backend import raybackend

def fail(self, backend_config):
    time.sleep(1)  # the ServerApp meanwhile waits for its clients
    print(f"FAILED_AT {time.time()}", flush=True)
    raise RuntimeError("The current node timed out during startup (injected)")

raybackend.RayBackend.init_ray = fail
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ray_start_failure_ends_sim_at_once_with_the_first_error_recorded(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "results"
    run_config = f'output-dir="{out}" cache-dir="{tmp_path / "cache"}" model="tiny-cnn" image-size=16'
    proc = subprocess.run(
        [
            sys.executable,
            str(driver),
            str(ROOT / "sim.py"),
            "--run-config",
            run_config,
            "synthetic-per-class=6",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,  # unfixed, the ServerApp's thread held the process for its handshake timeout (30 min)
    )
    ended = time.time()
    failed_at = float(
        next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED_AT"))
    )
    assert ended - failed_at < 15, f"sim.py took {ended - failed_at:.1f} s to end after Ray failed"
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: The current node timed out during startup (injected)"], proc.stderr
    assert "Traceback" not in proc.stderr
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "timed out during startup (injected)" in summary["error"]
    assert f"its folder records why (summary.json: status, error): {run_dir}" in proc.stderr


def test_a_signal_after_a_failure_keeps_the_first_error(tmp_path, monkeypatch, capsys):
    recorder = RunRecorder(tmp_path / "run", "fedavg", {})
    recorder.update_extra({"status": "running", "error": ""})
    monkeypatch.setitem(server_app.CURRENT, "recorder", recorder)
    assert server_app.record_end(recorder, "failed", "RuntimeError: the first")
    assert not server_app.record_end(recorder, "failed", "RuntimeError: a later one")
    sim._interrupted(signal.SIGINT)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", "RuntimeError: the first")
    assert "it had already ended: RuntimeError: the first" in capsys.readouterr().err


def test_a_signal_while_running_is_recorded(tmp_path, monkeypatch):
    recorder = RunRecorder(tmp_path / "run", "fedavg", {})
    recorder.update_extra({"status": "running", "error": ""})
    monkeypatch.setitem(server_app.CURRENT, "recorder", recorder)
    sim._interrupted(signal.SIGTERM)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("interrupted", "stopped by SIGTERM")
