"""Results name their data: with node-config data (each hospital's own ``data-path``/``dataset``)
the run folder's name, config.json and summary.json say so, per client; a simulation's data is the
run config's.  The real ServerApp and ClientApp in one process (bench/loop_grid.py)."""

import json
import logging
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, RecordDict
from PIL import Image

import registry
import server_app
import sim
from bench.loop_grid import TINY_RUN, LoopGrid
from client_app import app as client_app

RUN = {**TINY_RUN, "num-server-rounds": 1}


def hospital(root: Path, per_class: int) -> int:
    """``root/<class>/<image>.png``, two classes told apart by brightness; returns the image count."""
    rng = np.random.default_rng(per_class)
    for c, name in enumerate(["melanoma", "nevus"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = (rng.integers(0, 50, (14, 14, 3)) + 150 * c).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return 2 * per_class


def test_node_config_data_is_recorded_per_client(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HOME", str(tmp_path))  # the hospitals name their folders with "~"
    images = {"0": hospital(tmp_path / "hospital-a", 6), "1": hospital(tmp_path / "hospital-b", 7)}
    run_config = sim.resolved_run_config(
        {**RUN, "output-dir": str(tmp_path / "results"), "classes": "melanoma,nevus"}
    )
    grid = LoopGrid(run_config, 2, client_app)
    for i, ctx in enumerate(grid.contexts.values()):
        name = f"hospital-{'ab'[i]}"
        ctx.node_config = {"partition-id": i, "site": name, "dataset": "folder", "data-path": f"~/{name}"}
    context = Context(
        run_id=grid.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    server_app.main(grid, context)

    run_dir = Path(context.state["fedderm"]["run-dir"])
    assert run_dir.name.startswith("fedavg-node-config-folder-"), run_dir.name
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "done"
    data = config["client-data"]
    assert summary["config"]["client-data"] == data
    for pid, name in (("0", "hospital-a"), ("1", "hospital-b")):
        entry = data[pid]
        assert entry["dataset"] == "folder" and entry["source"] == "node-config"
        assert entry["data-path"] == f"~/{name}" and entry["site"] == name  # as the hospital named it
        assert entry["images"] == images[pid] == entry["train"] + entry["val"] + entry["test"]
        counts = summary["classes"]["counts"][pid]
        assert entry["test"] == sum(counts["test"].values()) and entry["train"] == sum(
            counts["train"].values()
        )
    # the record is no run-config key: a resume of this folder reads its config as before
    assert "client-data" not in server_app.saved_run_config(run_dir)
    registry.load_config(server_app.saved_run_config(run_dir))


def test_simulation_data_is_the_run_configs(tmp_path, caplog):
    run_config = sim.resolved_run_config({**RUN, "output-dir": str(tmp_path)})
    grid = LoopGrid(run_config, 2, client_app)
    state = RecordDict({server_app.CLI_RECORD: ConfigRecord({"preset": "", "overrides": "{}"})})
    context = Context(run_id=grid.run_id, node_id=0, node_config={}, state=state, run_config=run_config)
    with caplog.at_level(logging.INFO, logger="flwr"):
        server_app.main(grid, context)  # as sim.py runs it
    run_dir = Path(context.state["fedderm"]["run-dir"])
    assert not [r for r in caplog.records if r.getMessage().startswith("results:")]  # sim.py prints it
    assert run_dir.name.startswith("fedavg-synthetic-")
    data = json.loads((run_dir / "config.json").read_text())["client-data"]
    assert sorted(data) == ["0", "1"]
    assert {(d["dataset"], d["data-path"], d["source"]) for d in data.values()} == {
        ("synthetic", "", "run-config")
    }
    assert all(d["images"] == d["train"] + d["val"] + d["test"] > 0 for d in data.values())
    # what the numbers depend on besides the seed, as each client reports it
    assert {(d["torch"], d["torch-threads"], d["device"]) for d in data.values()} == {
        (torch.__version__, torch.get_num_threads(), "cpu")
    }
