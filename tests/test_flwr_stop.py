"""``flwr stop`` ends a ``flwr run`` simulation cleanly: the run folder records ``stopped`` and no
process of the run (Ray's included) outlives it; ``fedderm-run`` (``fedderm.run``) then exits
non-zero with the run's own line.

One real run on a simulation SuperLink of the test's own (Flower's ``flwr run .`` path, with
``flower-superlink --simulation`` as Flower's local SuperLink starts it), stopped after round 1.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from proc_helpers import wait_for

from deploy.loopback import APP_DIR, Loopback, _bin, free_port, listening, run_config_arg
from fedderm import procs
from fedderm.accel.allow import copy_bundle_files
from fedderm.run import outcome
from server_app import STOPPED

_STARTED = re.compile(r"Successfully started run (\d+)")

#: a tiny model on tiny data, more rounds than the test waits for (the stop reaches the run at
#: Flower's next heartbeat, 17.5-22.5 s later)
RUN_CONFIG = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "local-epochs": 1,
    "num-server-rounds": 100,
}


def _round_one(out) -> bool:
    return any(
        line.startswith("1,") for path in out.glob("*/rounds.csv") for line in path.read_text().splitlines()
    )


@pytest.mark.federation
def test_flwr_stop_records_stopped_and_leaves_no_ray_process(tmp_path):
    out = tmp_path / "results"
    with Loopback(tmp_path / "link", 0) as fed:
        port = free_port()
        superlink = fed.spawn(
            "superlink",
            [
                _bin("flower-superlink"),
                "--insecure",
                "--simulation",
                "--isolation",
                "subprocess",
                "--disable-runtime-dependency-installation",
                "--database",
                ":flwr-in-memory:",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            home="superlink",
        )
        config = fed.env("cli")["FLWR_HOME"] + "/config.toml"
        with open(config, "w") as fh:
            fh.write(
                f'[superlink]\ndefault = "t"\n\n[superlink.t]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
            )
        wait_for(lambda: listening(port), "the SuperLink listens", 60)
        app = str(copy_bundle_files(APP_DIR, tmp_path / "app"))  # the bundle, without the checkout's .venv
        # a run config Flower refuses: Flower's message; fedderm-run names the key before Flower runs
        refused = fed.flwr("run", app, "t", "--run-config", "num-server-round=2")
        assert "Invalid run configuration" in refused.stdout, refused.stdout
        wrapped = subprocess.run(
            [sys.executable, "-m", "fedderm.run", app, "t", "--run-config", "num-server-round=2"],
            capture_output=True,
            text=True,
            env=fed.env("cli"),
            timeout=120,
        )
        assert wrapped.returncode == 2, wrapped.stdout + wrapped.stderr
        assert "Invalid run configuration" not in wrapped.stdout  # Flower was not asked
        assert "Did you mean 'num-server-rounds'" in wrapped.stderr

        run_config = run_config_arg(
            {**RUN_CONFIG, "output-dir": str(out), "cache-dir": str(tmp_path / "cache")}
        )
        wrapper = fed.spawn(
            "fedderm-run",
            [sys.executable, "-m", "fedderm.run", app, "t", "--run-config", run_config],
            home="cli",
        )
        run_id = wait_for(lambda: _STARTED.findall(wrapper.log.read_text()), "the run starts", 120)[0]
        wait_for(lambda: _round_one(out), "round 1 is recorded", 300)
        running = fed.processes()
        stays = {superlink.popen.pid} | {pid for pid, cmd in running.items() if "flower-superexec" in cmd}
        run = set(running) - stays  # flwr-simulation (ServerApp, Ray's driver) and Ray's processes
        assert any("flwr-simulation" in running[pid] for pid in run), running
        assert any("raylet" in running[pid] for pid in run), running

        assert fed.flwr("stop", run_id, "t").returncode == 0
        (summary_path,) = out.glob("*/summary.json")
        summary = wait_for(
            lambda: (s := json.loads(summary_path.read_text()))["status"] != "running" and s,
            "the run folder records the stop",
            60,
        )
        assert (summary["status"], summary["error"]) == STOPPED
        # the SuperLink and its SuperExec stay up for the next run; nothing else of the run does
        # (Flower's SuperExec does not reap the ended flwr-simulation: a zombie, not listed)
        wait_for(lambda: not set(fed.processes()) - stays, "every process of the run ends", 60)
        # fedderm-run ends with the run, non-zero, with the run's own line
        assert wrapper.popen.wait(timeout=60) == 1
        tail = wrapper.log.read_text().splitlines()[-2:]
        assert tail == [
            f"error: {STOPPED[1]}",
            f"the run's folder records why (summary.json: status, error): {summary_path.parent}",
        ], tail


def _folder(tmp_path, status: str, error: str = ""):
    (tmp_path / "summary.json").write_text(json.dumps({"status": status, "error": error}))
    return tmp_path


def test_fedderm_run_exit_code_and_line_come_from_the_run_folder_then_flower(tmp_path):
    assert outcome(("finished:completed", ""), _folder(tmp_path, "done")) == (0, "")
    assert outcome(("finished:completed", ""), None) == (0, "")
    first = "RuntimeError: clients refused the run or could not load their data: client 1: no images"
    assert outcome(("finished:failed", "Simulation failed"), _folder(tmp_path, "failed", first)) == (1, first)
    assert outcome(("finished:completed", ""), _folder(tmp_path, "done")) == (0, "")
    assert outcome(("finished:failed", ""), _folder(tmp_path, "done")) == (
        1,
        "summary.json says done, Flower says finished:failed",
    )
    # the folder never learnt the end (or is on another host): Flower's status, its first line
    details = "Simulation failed with exception: boom\nTraceback (most recent call last):"
    expected = (1, "the run ended as finished:failed: Simulation failed with exception: boom")
    assert outcome(("finished:failed", details), _folder(tmp_path, "running")) == expected
    assert outcome(("finished:stopped", ""), None) == (1, "the run ended as finished:stopped")


#: a flwr-simulation process as a SIGTERM leaves it: the handler ray.init installs in the main
#: thread (in place of Flower's) calls sys.exit there, while the ServerApp's thread waits on
EXIT_AROUND_FLOWER = """
import subprocess, sys, threading, time
from pathlib import Path
import server_app
from fedderm.results import RunRecorder

recorder = RunRecorder(Path(sys.argv[1]), "fedavg", {})
recorder.update_extra({"status": "running", "error": ""})
child = subprocess.Popen(["sleep", "300"])  # as Ray's GCS and raylet are this process's children
print("child", child.pid, flush=True)

def serverapp():
    server_app.CURRENT["recorder"] = recorder
    server_app.stop_on_flower_exit()
    time.sleep(300)  # waiting for replies that will not come

threading.Thread(target=serverapp).start()
time.sleep(1)
sys.exit(15)
"""


def test_an_exit_around_flowers_exit_path_records_the_stop_and_ends_the_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(APP_DIR)}
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", EXIT_AROUND_FLOWER, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=APP_DIR,
        timeout=120,
    )
    assert time.monotonic() - started < 60, "the ServerApp's thread held the process"
    assert res.returncode == 1, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == STOPPED
    child = int(res.stdout.split()[1])
    state = procs.stat(child)
    assert state is None or state.state == "Z", f"the child {child} outlived the process"
