"""An adversary's moves on paths, files and threads, each refused: a server that names where a
hospital writes, a client that names where the server writes, a power cut that leaves a damaged
checkpoint, a pickle that would run code placed where fedderm loads files, a failed run that
leaves a thread behind; and the run folder's size on disk."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import numpy as np
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
from fedderm.checkpoint import CheckpointError, latest_checkpoint, resume_step, save_checkpoint
from fedderm.config import ConfigError
from fedderm.paths import inside, is_safe_component, safe_component
from fedderm.state_store import StateStore, register_simulation, unregister_simulation
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


# -- a power cut: the newest checkpoint damaged ------------------------------------------------
def _payload(value: float, best_round: int) -> dict:
    arrays = {"w": torch.full((8,), value)}
    return {
        "arrays": arrays,
        "strategy": {"best_round": best_round, "best_arrays": {"w": torch.full((8,), float(best_round))}},
        "recorder": {"rounds": [value]},
        "state-step": int(value),
    }


@pytest.mark.parametrize("damage", ["zero-byte", "truncated"])
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_used(damage, tmp_path, caplog):
    for r in (1, 2):
        save_checkpoint(tmp_path, "train", r, _payload(float(r), best_round=1), keep=3)
    newest = tmp_path / "checkpoint-round-2.pt"
    newest.write_bytes(b"" if damage == "zero-byte" else newest.read_bytes()[:-100])

    with caplog.at_level(logging.ERROR, logger="flwr"):
        ckpt = latest_checkpoint(tmp_path, "train")

    assert ckpt["round"] == 1 and torch.equal(ckpt["arrays"]["w"], torch.ones(8))
    assert torch.equal(ckpt["strategy"]["best_arrays"]["w"], torch.ones(8))
    assert "checkpoint-round-2.pt" in caplog.text and "damaged" in caplog.text
    assert resume_step(tmp_path) == 1  # the clients roll back to the checkpoint the server resumes from


def test_a_checkpoint_of_an_older_fedderm_gets_a_clear_message(tmp_path):
    # FedCLF's relay bank was numpy: a checkpoint of that time holds arrays weights_only refuses
    old = {"stage": "train", "round": 1, **_payload(1.0, best_round=1)}
    old["strategy"] = {**old["strategy"], "uploads": {0: np.ones((2, 3), np.float32)}}
    torch.save(old, tmp_path / "checkpoint-round-1.pt")
    with pytest.raises(CheckpointError, match="checkpoint-round-1.pt .*older than its weights-only"):
        latest_checkpoint(tmp_path, "train")


def test_numpy_state_goes_into_a_checkpoint_and_comes_back_as_numpy(tmp_path):
    payload = _payload(1.0, best_round=1)
    uploads = {0: np.arange(6, dtype=np.float32).reshape(2, 3), 1: np.float64(0.5)}
    payload["strategy"] = {**payload["strategy"], "uploads": uploads}
    save_checkpoint(tmp_path, "train", 1, payload)
    back = latest_checkpoint(tmp_path, "train")["strategy"]["uploads"]
    assert isinstance(back[0], np.ndarray) and back[0].dtype == np.float32 and (back[0] == uploads[0]).all()
    assert isinstance(back[1], np.float64) and back[1] == 0.5


def test_checkpoints_name_one_file_per_model_and_keep_only_what_they_name(tmp_path):
    initial = {"w": torch.zeros(8)}
    models = {r: {"w": torch.full((8,), float(r))} for r in (1, 2, 3, 4)}

    def save(r, best_round):
        best = initial if best_round == 0 else models[best_round]
        strategy = {"best_round": best_round, "best_arrays": {k: v.clone() for k, v in best.items()}}
        save_checkpoint(tmp_path, "train", r, {"arrays": models[r], "strategy": strategy}, keep=2)

    save(1, best_round=0)  # the initial model is the best: a file of its own
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best-round-0.pt",
        "checkpoint-round-1.pt",
        "global-round-1.pt",
    ]
    save(2, best_round=1)  # round 1's global model is the best: named, not copied
    save(3, best_round=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-round-2.pt",
        "checkpoint-round-3.pt",
        "global-round-1.pt",
        "global-round-2.pt",
        "global-round-3.pt",
    ]
    # a crashed run left another round-4 model behind: the new checkpoint does not take it
    torch.save(
        {"stage": "train", "round": 4, "arrays": {"w": torch.full((8,), -1.0)}},
        tmp_path / "global-round-4.pt",
    )
    save(4, best_round=4)
    ckpt = latest_checkpoint(tmp_path, "train")
    assert torch.equal(ckpt["arrays"]["w"], models[4]["w"]) and torch.equal(
        ckpt["strategy"]["best_arrays"]["w"], models[4]["w"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-round-3.pt",
        "checkpoint-round-4.pt",
        "global-round-1.pt",
        "global-round-3.pt",
        "global-round-4.pt",
    ]


def test_checkpoints_and_client_state_reach_the_disk_before_their_names(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run", "train", 1, _payload(1.0, best_round=1))
    names = [Path(p).name for p in synced]
    # each file flushed, then the folder it was renamed in
    for final in ("global-round-1.pt", "checkpoint-round-1.pt"):
        i = next(i for i, n in enumerate(names) if n.startswith(f".{final}.") and n.endswith(".tmp"))
        assert names[i + 1] == "run", names
    synced.clear()
    store = StateStore(tmp_path / "client-0", keep=2, label="client 0")
    snap = store.open(1)
    snap.put("w", {"a": torch.ones(3)})
    snap.commit()
    names = [Path(p).name for p in synced]
    tensors = next(i for i, n in enumerate(names) if n.startswith(".w.s1.0.safetensors."))
    manifest = next(i for i, n in enumerate(names) if n.startswith(".step-1.json."))
    assert names[tensors + 1] == names[manifest + 1] == "client-0" and tensors < manifest


class Killed(Exception):
    """Stands for the server's machine losing power."""


def test_resume_after_a_power_cut_that_emptied_the_newest_checkpoint_equals_the_full_run(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = {**TINY_RUN, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out")}
    full = run_app({**base, "run-name": "full"})
    save = common.save_checkpoint

    def cut_after_round_2(run_dir, stage, server_round, payload, keep=2):
        path = save(run_dir, stage, server_round, payload, keep)
        if server_round == 2:
            path.write_bytes(b"")  # the rename reached the disk, the data did not
            raise Killed("power cut after the round-2 checkpoint")
        return path

    monkeypatch.setattr(common, "save_checkpoint", cut_after_round_2)
    with pytest.raises(Killed):
        run_app({**base, "run-name": "cut"})
    monkeypatch.setattr(common, "save_checkpoint", save)
    cut = tmp_path / "out" / "cut"
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert run_app({"resume": str(cut)}) == cut

    assert f"{cut / 'checkpoint-round-2.pt'}" in caplog.text and "resuming train after round 1" in caplog.text
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, cut))
    assert a["final"] == b["final"] and a["rounds"] == b["rounds"] and b["status"] == "done"
    wa, wb = (torch.load(d / "model.pt", weights_only=True) for d in (full, cut))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# -- a pickle that would run code -------------------------------------------------------------
class RunsCode:
    """Unpickled, writes ``marker``: what a planted pickle would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def plant(path: Path, marker: Path, **fields) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**fields, "payload": RunsCode(marker)}, path)


def test_a_planted_checkpoint_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    save_checkpoint(tmp_path, "train", 1, _payload(1.0, best_round=1))
    plant(tmp_path / "checkpoint-round-2.pt", marker, stage="train", round=2)
    with pytest.raises(CheckpointError, match="checkpoint-round-2.pt"):
        latest_checkpoint(tmp_path, "train")
    with pytest.raises(CheckpointError, match="checkpoint-round-2.pt"):
        resume_step(tmp_path)
    assert not marker.exists()


def test_a_planted_synthetic_cache_is_refused_not_run(tmp_path):
    from fedderm.data.synthetic import load_synthetic

    marker = tmp_path / "ran"
    first = load_synthetic(2, 3, 16, 0, cache_dir=tmp_path / "cache")
    (cached,) = (tmp_path / "cache").glob("synthetic-*.pt")
    plant(cached, marker)
    again = load_synthetic(2, 3, 16, 0, cache_dir=tmp_path / "cache")
    assert not marker.exists()
    assert torch.equal(again.images, first.images) and (again.labels == first.labels).all()
    assert (
        load_synthetic(2, 3, 16, 0, cache_dir=tmp_path / "cache").labels == first.labels
    ).all()  # rewritten


def test_a_planted_decoded_image_cache_is_refused_not_run(tmp_path):
    from fedderm.data.cache import _cached
    from fedderm.data.synthetic import generate

    marker = tmp_path / "ran"
    pool = generate(2, 3, 16, 0)
    plant(tmp_path / "folder-abc.pt", marker)
    again = _cached(tmp_path, "folder-abc", lambda: pool)
    assert not marker.exists() and again is pool


def test_a_planted_text_embedding_cache_is_refused_not_run(tmp_path, monkeypatch):
    from fedderm import sift

    calls = []

    def encode(model_name, texts, pooling="mean"):
        calls.append(texts)
        return torch.ones(len(texts), 4)

    monkeypatch.setattr(sift, "encode_texts", encode)
    monkeypatch.setattr(sift, "_fingerprint", lambda name: name)
    sift.class_text_embeddings("m", ["a", "b"], cache_dir=tmp_path)
    (cached,) = (tmp_path / "sift-text").glob("*.pt")
    marker = tmp_path / "ran"
    plant(cached, marker)
    assert torch.equal(sift.class_text_embeddings("m", ["a", "b"], cache_dir=tmp_path), torch.ones(2, 4))
    assert not marker.exists() and len(calls) == 2


def test_a_planted_model_file_is_refused_not_run(tmp_path):
    from fedderm.inference import load_model

    marker = tmp_path / "ran"
    plant(tmp_path / "model-best.pt", marker)
    with pytest.raises(ValueError, match="model-best.pt"):
        load_model(tmp_path / "model-best.pt")
    assert not marker.exists()


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


# -- the run folder's size ---------------------------------------------------------------------
#: the default run's folder (ResNet-18, 64 px, 5 classes, num-server-rounds 8, keep-checkpoints 2):
#: at most this many model-sized files (the global models of the 2 checkpoints kept, the best-on-val
#: model they name, model.pt, model-best.pt); 8 before the checkpoint policy
DEFAULT_RUN_MODELS = 5


def test_the_default_runs_folder_stays_below_five_models(tmp_path):
    """The checkpoints and model files of the default run, written as its rounds write them, with
    the best round early (the most files: it differs from the newest checkpoints)."""
    from fedderm.models import create_classifier
    from fedderm.results import RunRecorder

    cfg = registry.load_config({})
    model = create_classifier(cfg, 5)
    recorder = RunRecorder(tmp_path / "run", cfg.method, cfg.to_flat())
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    grid = type("Grid", (), {"state_clock": None})()
    best = None
    for r in range(1, cfg.num_server_rounds + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        arrays = {k: v.clone() for k, v in model.state_dict().items()}
        best = arrays if r == 1 else best
        strategy = {"best_round": 1, "best_score": 0.5, "best_arrays": best, "last_mean": {}}
        common.save_round(
            grid,
            recorder,
            "train",
            r,
            {"arrays": arrays, "strategy": strategy, "recorder": recorder.state()},
            cfg.keep_checkpoints,
        )
    recorder.save_model(arrays)
    recorder.save_model(best, name="model-best.pt")
    recorder.close()
    size = sum(p.stat().st_size for p in recorder.run_dir.rglob("*") if p.is_file())
    assert size < DEFAULT_RUN_MODELS * model_bytes + 2**20, size / 2**20
    assert sorted(p.name for p in recorder.run_dir.glob("*.pt")) == [
        "checkpoint-round-7.pt",
        "checkpoint-round-8.pt",
        "global-round-1.pt",
        "global-round-7.pt",
        "global-round-8.pt",
        "model-best.pt",
        "model.pt",
    ]
    resumed = latest_checkpoint(recorder.run_dir, "train")
    assert all(torch.equal(resumed["strategy"]["best_arrays"][k], best[k]) for k in best)
    assert all(torch.equal(resumed["arrays"][k], arrays[k]) for k in arrays)


def test_the_server_does_not_choose_where_a_hospital_caches_its_images(tmp_path, monkeypatch):
    """A hospital's node (its own data-path, neither cache-dir nor state-dir) caches in its user's
    folder, not in the run config's cache-dir the server sends; a simulation's node keeps the run
    config's (the user's own run)."""
    from flwr.app import Context, RecordDict
    from PIL import Image

    import sim
    from clients import common

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for c in ("a", "b"):
        (tmp_path / "images" / c).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (12, 12), (40 * i, 100 * (c == "b"), 0)).save(
                tmp_path / "images" / c / f"{i}.png"
            )
    chosen = tmp_path / "server-chose-this"
    run_config = sim.resolved_run_config(
        {"image-size": 16, "synthetic-per-class": 4, "cache-dir": str(chosen), "min-clients": 1}
    )

    def cache_of(node_config):
        common.forget_sessions()
        context = Context(
            run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config
        )
        return common.session(context).cfg.cache_dir

    hospital_cache = cache_of({"partition-id": 0, "dataset": "folder", "data-path": str(tmp_path / "images")})
    assert hospital_cache == str(tmp_path / "xdg" / "fedderm" / "cache")
    assert not chosen.exists()
    # a simulation's node: the run config is the user's own, its cache-dir is where the user wants it
    assert cache_of({"partition-id": 0, "num-partitions": 1}) == str(chosen)
    common.forget_sessions()
