"""What Flower must still do for each entry of ``fedderm.flower_private.EXCEPTIONS`` (the app's only
private Flower names) to be right, and for the Flower behaviours the app copies instead of
importing (the chunk size :mod:`wire` packs by).  A Flower release that changes one fails here."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import tomllib
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

import wire
from fedderm import flower_private

ROOT = Path(__file__).resolve().parents[1]


def test_the_run_config_is_fused_as_flwr_run_fuses_it():
    """get_fused_config_from_dir: pyproject's [tool.flwr.app.config], flattened with dotted keys,
    each override replacing its key; a key pyproject lacks is refused."""
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    fused = flower_private.fused_run_config(ROOT, {"seed": 7, "method": "fedprox"})
    assert fused["seed"] == 7 and fused["method"] == "fedprox"
    assert fused["lr"] == defaults["lr"] and fused["num-server-rounds"] == defaults["num-server-rounds"]
    nested = {f"{k}.{j}": w for k, v in defaults.items() if isinstance(v, dict) for j, w in v.items()}
    assert all(fused[k] == v for k, v in nested.items())  # a [table] becomes dotted keys
    assert set(fused) == {k for k, v in defaults.items() if not isinstance(v, dict)} | set(nested)
    assert fused["dp.clip-norm"] == defaults.get("dp.clip-norm", nested.get("dp.clip-norm"))
    with pytest.raises(ValueError, match="no-such-key"):
        flower_private.fused_run_config(ROOT, {"no-such-key": 1})


def test_the_audit_size_is_the_serialised_contents_size():
    """recorddict_to_proto(...).ByteSize(): the bytes of the content as Flower serialises it, so
    an array of n bytes more makes the content n bytes (plus its length prefix) bigger."""
    small = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(10, np.float32))})})
    big = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(1010, np.float32))})})
    metrics = RecordDict({"metrics": MetricRecord({"loss": 0.5, "num-examples": 3})})
    grown = flower_private.content_size(big) - flower_private.content_size(small)
    assert 4000 <= grown <= 4000 + 8
    assert flower_private.content_size(big) >= sum(r.count_bytes() for r in big.values())
    assert 0 < flower_private.content_size(metrics) < 100
    assert flower_private.content_size(RecordDict()) == 0


def test_a_deployment_grid_is_told_from_a_simulation_one():
    """The SuperLink's grid class (HttpGrid) is a Grid, and the ServerApp packs messages on it
    only; the in-memory grid is checked by the simulation test below."""
    from flwr.serverapp import Grid
    from flwr.superlink.grid import HttpGrid

    from strategies.fastpoll import IN_MEMORY_POLL_INTERVAL, POLL_INTERVAL, FastPollGrid

    grid = HttpGrid(token="t")  # connects only when used
    assert isinstance(grid, Grid) and flower_private.grid_kind(grid) == "deployment"
    fast = FastPollGrid(grid)
    assert fast.pack and fast.kind == "deployment" and fast.poll_interval == POLL_INTERVAL
    assert flower_private.grid_kind(object()) == "other" and not FastPollGrid(object()).pack

    class Declared:  # a test's in-process grid that stands for the simulation's
        fedderm_grid_kind = "simulation"

    assert FastPollGrid(Declared()).kind == "simulation" and not FastPollGrid(Declared()).pack
    assert IN_MEMORY_POLL_INTERVAL < POLL_INTERVAL


@pytest.mark.parametrize("extra", [0, 1])
def test_flower_cuts_arrays_into_the_chunks_wire_packs_by(extra):
    """A packed message up to wire.FLOWER_CHUNK_BYTES travels inline, above it as one Array: the
    size at which Flower starts a second chunk."""
    data = np.random.default_rng(0).bytes(wire.FLOWER_CHUNK_BYTES + extra)
    array = Array(dtype="uint8", shape=(len(data),), stype="bytes", data=data)
    assert len(array.children) == 1 + extra


def test_the_accelerated_superlink_marks_the_processes_it_starts(monkeypatch):
    """fedderm-superlink sets server_app.ACCELERATED for its children; Flower's own does not."""
    import importlib

    import server_app
    from fedderm.accel import superlink, waits

    cli = importlib.import_module("flwr.superlink.cli.flower_superlink")
    # recorded (set, then removed) so that the variable superlink_main sets is removed at teardown:
    # delenv of an absent variable records nothing, and later in-process runs would be "accelerated"
    monkeypatch.setenv(server_app.ACCELERATED, "")
    monkeypatch.delenv(server_app.ACCELERATED)
    monkeypatch.setattr(superlink, "link_state_in_memory", lambda: None)
    monkeypatch.setattr(superlink, "hold_pulls", lambda: None)
    seen = {}
    monkeypatch.setattr(
        cli, "flower_superlink", lambda: seen.update(env=os.environ.get(server_app.ACCELERATED))
    )
    monkeypatch.setattr("sys.argv", ["x"])
    superlink.superlink_main(["--insecure"])
    assert seen["env"] == "1" and waits.ACCELERATED_ENV == server_app.ACCELERATED


def test_the_in_process_simulation_takes_a_prepared_context_and_gives_clients_the_overrides(monkeypatch):
    """_run_simulation (with the Run and task identity of simulation_run): the ServerApp gets the
    Context given (its run config, its state), on the in-memory grid; it can create and send
    messages; every ClientApp's run config is pyproject's fused with the Run's overrides; the
    final Context comes back.  Run off the main thread, as sim.py runs it (Ray then leaves the
    process's SIGTERM handler alone)."""
    import signal

    import sim

    seen = {}
    server = ServerApp()

    @server.main()
    def main(grid, context):
        seen["kind"] = flower_private.grid_kind(grid)
        seen["server-seed"] = context.run_config["seed"]
        seen["given"] = dict(context.state["given"])
        deadline = time.monotonic() + 120
        while not (nodes := list(grid.get_node_ids())) and time.monotonic() < deadline:
            time.sleep(0.05)
        out = Message(
            RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=nodes[0], message_type="query"
        )
        (reply,) = grid.send_and_receive([out], timeout=120)
        seen["client"] = dict(reply.content["metrics"])
        context.state["done"] = ConfigRecord({"ok": True})

    client = ClientApp()

    @client.query()
    def query(msg, context):
        cfg = context.run_config
        metrics = MetricRecord({"seed": cfg["seed"], "lr": cfg["lr"], "rounds": cfg["num-server-rounds"]})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    overrides = {"seed": 7, "lr": 0.25}
    run = flower_private.simulation_run(overrides)
    fused = flower_private.fused_run_config(ROOT, overrides)
    state = RecordDict({"given": ConfigRecord({"preset": "p"})})
    context = Context(run_id=run.run_id, node_id=0, node_config={}, state=state, run_config=fused)
    handler = signal.getsignal(signal.SIGTERM)
    final = sim.off_main_thread(
        flower_private.run_simulation_in_process,
        server_app=server,
        client_app=client,
        num_supernodes=1,
        context=context,
        run=run,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 1, "log_to_driver": False, "logging_level": logging.ERROR},
        },
        app_dir=ROOT,
    )
    assert signal.getsignal(signal.SIGTERM) is handler  # Ray's sys.exit handler did not replace it
    assert seen["kind"] == "simulation" and seen["server-seed"] == 7 and seen["given"] == {"preset": "p"}
    assert seen["client"] == {"seed": 7, "lr": 0.25, "rounds": fused["num-server-rounds"]}
    assert final.state["done"]["ok"] is True and final.run_id == run.run_id


def test_off_main_thread_returns_the_value_and_raises_the_error_in_the_caller():
    import threading

    import sim

    assert sim.off_main_thread(lambda a, b=0: (threading.current_thread().name, a + b), 1, b=2) == (
        "flower-simulation",
        3,
    )

    def fail():
        raise KeyError("the runtime failed")

    with pytest.raises(KeyError, match="the runtime failed"):
        sim.off_main_thread(fail)


#: a ``flwr-simulation`` process as Flower 1.42 runs one (flwr/simulation/app.py): Flower's signal
#: handlers with its own exit handler, the ServerApp in a thread of its own, and the heartbeat of a
#: run that ``flwr stop`` ended
STOPPED_RUN = """
import threading, time
from flwr.supercore.exit import register_signal_handlers
from flwr.supercore.heartbeat import make_task_heartbeat_fn_http
from flwr.supercore.telemetry import EventType
from fedderm import flower_private

register_signal_handlers(
    event_type=EventType.FLWR_SIMULATION_RUN_LEAVE,
    exit_message="Task stopped by user.",
    exit_handlers=[lambda: print("flower pushes the final status", flush=True)],
)
flower_private.on_flower_exit(lambda: print("the app records the stop", flush=True))
threading.Thread(target=time.sleep, args=(300,), name="serverapp").start()  # never returns

class StoppedRun:  # the SuperLink's answer to the heartbeat of a stopped run
    def SendTaskHeartbeat(self, request):
        return type("Response", (), {"success": False})()

time.sleep(0.5)
print("stop", time.time(), flush=True)
threading.Thread(target=make_task_heartbeat_fn_http(StoppedRun()), daemon=True).start()
for _ in range(3000):  # the main thread in short waits, as in Flower's own processes (1.43's
    time.sleep(0.1)  # heartbeat raises SIGINT in its own thread: the main thread runs the handler)
"""


def test_flower_stop_runs_the_app_exit_handler_and_ends_the_process():
    """on_flower_exit (add_exit_handler): when the heartbeat learns that the run was stopped,
    Flower's SIGINT handler runs the app's handler first, then its own (which pushes the final
    status), and ends the process within its force-exit delay although the ServerApp's thread is
    still blocked; neither atexit nor the app's thread could have recorded the stop."""
    import subprocess
    import sys

    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", STOPPED_RUN], capture_output=True, text=True, env=env, timeout=120
    )
    ended = time.time()
    lines = res.stdout.splitlines()
    assert res.returncode == 0, res.stderr  # Flower's graceful exit after SIGINT
    assert lines[1:] == ["the app records the stop", "flower pushes the final status"], res.stdout
    assert ended - float(lines[0].split()[1]) < 30, "Flower's force exit did not end the process"
    assert "Task stopped by user." in res.stderr + res.stdout
