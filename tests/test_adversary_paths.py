"""An adversary's moves on paths, files and threads, each refused: a server that names where a
hospital writes, a client that names where the server writes, a power cut that leaves a damaged
checkpoint, a pickle that would run code placed where fedderm loads files, a failed run that
leaves a thread behind; and the run folder's size on disk."""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

import registry
import server_app
import strategies.common as common
from bench.loop_grid import TINY_RUN, run_app
from clients.state import client_state, state_mod
from fedderm.config import ConfigError
from fedderm.paths import inside, is_safe_component, safe_component
from fedderm.state_store import register_simulation, unregister_simulation
from wire import STAMP


# -- helpers ----------------------------------------------------------------------------------
def files_under(root: Path, leave_out: Path | None = None) -> dict[str, bytes]:
    """Every file under ``root`` (but under ``leave_out``) with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (leave_out is None or leave_out not in p.parents)
    }


def server_message(stamp: dict) -> Message:
    """A train message from the server with the client-state record ``stamp`` (as a server could write it)."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 77, SUPERLINK_NODE_ID
    msg = Message(RecordDict({STAMP: ConfigRecord(stamp)}), dst_node_id=5, message_type="train")
    msg.metadata.__dict__["_message_id"] = secrets.token_hex(8)
    return msg


def store_an_entry(msg: Message, context: Context) -> Message:
    """A handler that keeps client state (as MOON's or SCAFFOLD's do)."""
    client_state(context).put("w", {"a": torch.arange(4.0)})
    return Message(RecordDict(), reply_to=msg)


def hospital(node_config: dict) -> Context:
    return Context(run_id=77, node_id=5, node_config=node_config, state=RecordDict(), run_config={})


def stamp(**fields) -> dict:
    return {"run": "r", "step": 3, "resume": 0, "token": secrets.token_hex(16), "keep": 1, **fields}


# -- the server does not decide where a hospital writes ---------------------------------------
def test_a_server_run_name_cannot_lead_a_hospital_out_of_its_state_dir(tmp_path):
    state_dir = tmp_path / "hospital" / "state"
    # where "../../../x" leads from <state-dir>/client-state: files the hospital keeps there
    victim = tmp_path / "x" / "client-0"
    victim.mkdir(parents=True)
    for name in ("step-1.json", "step-2.json", "w.s1.0.safetensors"):
        (victim / name).write_text("the hospital's own file")
    before = files_under(tmp_path)

    out = state_mod(
        server_message(stamp(run="../../../x")),
        hospital({"partition-id": 0, "state-dir": str(state_dir)}),
        store_an_entry,
    )

    assert not out.has_error()
    assert files_under(tmp_path, leave_out=state_dir) == before  # nothing written, changed or deleted
    (written,) = state_dir.rglob("*.safetensors")
    assert (
        written.parent.parent.parent == state_dir / "client-state"
    )  # <state-dir>/client-state/<run>/client-0
    assert is_safe_component(written.parent.parent.name) and written.parent.name == "client-0"


def test_a_run_dir_sent_to_a_deployed_client_is_not_where_it_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the SuperNode's own default folder
    elsewhere = tmp_path / "server-chose-this"

    out = state_mod(
        server_message(stamp(**{"run-dir": str(elsewhere)})), hospital({"partition-id": 0}), store_an_entry
    )

    assert not out.has_error()
    assert not elsewhere.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["xdg"]
    assert list((tmp_path / "xdg" / "fedderm" / "client-state" / "r" / "client-0").glob("*.safetensors"))


def test_only_a_simulation_registered_on_this_machine_puts_state_in_its_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    run_dir = tmp_path / "out" / "run"
    token = secrets.token_hex(16)
    register_simulation(token, run_dir)
    try:
        state_mod(server_message(stamp(token=token)), hospital({"partition-id": 1}), store_an_entry)
        assert list((run_dir / "client-state" / "client-1").glob("*.safetensors"))
        # the same folder named with a token this machine never registered: the client's default folder
        state_mod(server_message(stamp(run="other")), hospital({"partition-id": 1}), store_an_entry)
        assert not (run_dir / "client-state" / "other").exists()
        assert list(
            (tmp_path / "xdg" / "fedderm" / "client-state" / "other" / "client-1").glob("*.safetensors")
        )
    finally:
        unregister_simulation(token)
    assert not (tmp_path / "xdg" / "fedderm" / "simulations" / token).exists()


@pytest.mark.parametrize("bad", ["../../../x", "a/b", "..", ".", "", "/etc", "x\x00y", "é" * 200])
def test_safe_component_is_one_folder_name_and_keeps_names_apart(bad, tmp_path):
    name = safe_component(bad)
    assert is_safe_component(name) and name != safe_component(bad + "-")
    assert inside(tmp_path, name).parent == tmp_path.resolve()
    assert safe_component("fedavg-synthetic-20261127-170000-0042") == "fedavg-synthetic-20261127-170000-0042"


# -- a client does not decide where the server writes; nor does a run-name ----------------------
def test_a_client_dataset_cannot_lead_the_run_folder_out_of_output_dir(tmp_path):
    cfg = registry.load_config({"output-dir": str(tmp_path / "out"), "tensorboard": False})
    reported = {"0": {"dataset": "x/../../evil", "source": "node-config", "data-path": "/d"}}

    recorder = server_app.make_recorder(cfg, 7, data=reported)

    assert recorder.run_dir.parent == (tmp_path / "out").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert recorder.run_dir.name.startswith("fedavg-node-config-other-")
    assert (
        json.loads((recorder.run_dir / "config.json").read_text())["client-data"] == reported
    )  # as reported


@pytest.mark.parametrize("name", ["../x", "a/../../x", "..", ".hidden", "/tmp/x", "-x", "a b"])
def test_a_run_name_that_is_no_single_folder_is_refused(name, tmp_path):
    with pytest.raises(ConfigError, match="'run-name'"):
        registry.load_config({"run-name": name, "output-dir": str(tmp_path / "out")})
    # where the folder is made too, for a config that skipped the check
    cfg = dataclasses.replace(registry.load_config({"output-dir": str(tmp_path / "out")}), run_name=name)
    with pytest.raises(ConfigError, match="'run-name'"):
        server_app.run_dir_for(cfg, 1)
    assert not list(tmp_path.iterdir())


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
