"""Errors before heavy work: ``sim.py`` names a config mistake before torch, Flower or Ray is
imported, a data problem (more clients than images included) before Flower's simulation runtime or
Ray; ``fedderm-check`` (``sim.py --check``) runs the same checks without running anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from fedderm import check

ROOT = Path(__file__).resolve().parents[1]

#: ``sim.main(argv)`` in a fresh interpreter; prints which heavy modules it had imported when it returned
PROBE = """
import sys
import sim
code = sim.main(sys.argv[1:])
heavy = ("torch", "flwr", "ray", "flwr.simulation", "server_app", "client_app", "datasets")
print("IMPORTED", ",".join(m for m in heavy if m in sys.modules), flush=True)
sys.exit(code)
"""


def _probe(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return subprocess.run(
        [sys.executable, str(script), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
        timeout=300,
    )


def _imported(proc: subprocess.CompletedProcess) -> set[str]:
    line = next(line for line in proc.stdout.splitlines() if line.startswith("IMPORTED"))
    return set(filter(None, line.split(" ", 1)[1].split(",")))


def _folder(root: Path, per_class: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for cls, n in per_class.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


def test_a_config_mistake_is_named_before_torch_flower_or_ray_is_imported(tmp_path):
    proc = _probe(tmp_path, "--run-config", "num-server-round=2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "error: unknown run-config key 'num-server-round'. Did you mean 'num-server-rounds'?"
    )
    assert len(proc.stderr.strip().splitlines()) == 1
    assert _imported(proc) == set()


def test_more_clients_than_images_is_one_line_before_the_simulation_starts(tmp_path):
    data = _folder(tmp_path / "derm", {"nevus": 3, "melanoma": 3})
    config = f'dataset="folder" data-path="{data}" partition="iid" image-size=8 cache-dir="{tmp_path / "c"}"'
    proc = _probe(
        tmp_path, "--num-supernodes", "8", "--run-config", config, f'output-dir="{tmp_path / "out"}"'
    )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: client 6 has no images: 8 clients cannot share the 6 images of {data} (partition='iid'); "
        "use fewer clients (--num-supernodes, min-clients) or more images"
    ], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not {"ray", "flwr.simulation", "server_app", "client_app", "datasets"} & _imported(proc)
    assert not (tmp_path / "out").exists()


def test_check_reports_the_run_and_each_clients_data(tmp_path, capfd):
    config = f'model="tiny-cnn" image-size=8 synthetic-per-class=4 cache-dir="{tmp_path / "c"}"'
    assert check.main([str(ROOT), "--data", "--num-supernodes", "3", "--run-config", config]) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[0].startswith("run config ok: method fedavg · model tiny-cnn · 8 rounds · min-clients 2")
    clients = [line for line in out if line.startswith("data ok: client ")]
    assert [line.split(":")[1] for line in clients] == [" client 0", " client 1", " client 2"]
    # config only: no data line; a mistake is exit 2 with one line; a folder that is no app is named
    assert check.main([str(ROOT), "--run-config", config]) == 0
    assert "data ok" not in capfd.readouterr().out
    assert check.main([str(ROOT), "--run-config", "lr=fast"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run-config key 'lr': fast is not a value")
    assert check.main([str(tmp_path), "--run-config", config]) == 2
    assert "is not a fedderm app folder (no sim.py)" in capfd.readouterr().err


def test_check_a_hospitals_own_data_from_its_node_config(tmp_path, capfd):
    good = _folder(tmp_path / "hospital-a", {"melanoma": 8, "nevus": 8})
    config = f'model="tiny-cnn" image-size=8 cache-dir="{tmp_path / "c"}"'
    node = f'partition-id=4 dataset="folder" data-path="{good}"'
    assert check.main([str(ROOT), "--data", "--run-config", config, "--node-config", node]) == 0
    out = capfd.readouterr().out
    assert "data ok: client 4: train " in out and "classes (label order) melanoma 8, nevus 8" in out
    few = _folder(tmp_path / "hospital-b", {"melanoma": 1, "nevus": 1})
    node = f'partition-id=1 dataset="folder" data-path="{few}"'
    assert check.main([str(ROOT), "--data", "--run-config", config, "--node-config", node]) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: client 1 has only 2 images (its own data ")
    assert str(few) in err[0]


def test_every_console_script_names_a_callable():
    import importlib

    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedderm-check"] == "fedderm.check:entry"
    assert scripts["fedderm-predict"] == "fedderm.inference:predict_entry"
    for target in scripts.values():
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name)), target


def test_num_supernodes_defaults_to_min_clients(tmp_path, monkeypatch):
    import sim

    given = {}

    def fake_simulate(overrides, num_supernodes, *args, **kwargs):
        given["num"] = num_supernodes
        return tmp_path

    monkeypatch.setattr(sim, "simulate", fake_simulate)
    config = f'min-clients=3 model="tiny-cnn" image-size=8 synthetic-per-class=4 cache-dir="{tmp_path / "c"}"'
    assert sim.main(["--run-config", config]) == 0
    assert given["num"] is None  # no --num-supernodes: the simulation's own default
    assert sim.checked_run(sim.parse_overrides([config]), given["num"], data=False)[1] == 3
    assert sim.checked_run(sim.parse_overrides([config + ' holdout-centre="2"']), None, data=False)[1] == 4
