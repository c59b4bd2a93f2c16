"""sim.py as a user meets it: command-line mistakes, Ctrl-C and resume, a preset plus overrides,
the console, each method's default model, requires-python."""

import importlib.metadata
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import tomllib

import registry
import server_app
from fedderm.cli import parse_run_config
from fedderm.config import ConfigError
from fedderm.models import VIT_ARCHS, list_models

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _sim(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FORCE_COLOR", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "sim.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize(
    "args, named",
    [
        (["--num-supernodes", "2", "--run-config", "min-clients=3"], "'min-clients'"),
        (["--run-config", "model=resnet18"], "'model'"),
        (["--run-config", "lr=0.1 lr=0.2"], "'lr' is given twice"),
        (["--run-config", 'model="resnet-18"'], "Did you mean 'resnet18'"),
        (["--run-config", "seed=-1"], "'seed'"),
        (["--run-config", 'dataset="npz" data-path="/no/such/derma.npz"'], "'data-path': /no/such/derma.npz"),
    ],
    ids=[
        "min-clients-too-high",
        "unquoted-string",
        "duplicate-key",
        "unknown-model",
        "negative-seed",
        "missing-data-path",
    ],
)
def test_command_line_mistake_is_one_line_naming_the_key(args, named):
    t0 = time.monotonic()
    out = _sim(*args, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and named in out.stderr, (
        out.stderr
    )
    assert "Traceback" not in out.stderr + out.stdout and "round" not in out.stderr + out.stdout
    assert time.monotonic() - t0 < 60  # before Ray starts


def test_parser_preset_plus_overrides_and_tokens(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('method = "fedprox"\nlr = 0.5\n[fedclf]\nqueue-size = 8\n')
    flat, path, given = parse_run_config([str(preset), 'lr=0.1 run-name="a b"', "seed=3"])
    assert flat == {"method": "fedprox", "lr": 0.1, "fedclf.queue-size": 8, "run-name": "a b", "seed": 3}
    assert path == str(preset.resolve()) and given == {"lr": 0.1, "run-name": "a b", "seed": 3}
    with pytest.raises(ConfigError, match="'seed' is given twice"):
        parse_run_config(["seed=1", "seed=2"])
    with pytest.raises(ConfigError, match="'oops' is not key=value"):
        parse_run_config(["seed=1 oops"])
    with pytest.raises(ConfigError, match="not found"):
        parse_run_config([str(tmp_path / "none.toml")])


def test_every_method_runs_its_paper_model_when_model_is_unset():
    assert set(registry.VIT_MODELS) == set(VIT_ARCHS)
    for name, method in registry.METHODS.items():
        cfg = registry.load_config({"method": name})
        assert cfg.model == method.model and cfg.model in list_models()
        assert not method.models or cfg.model in method.models
    assert registry.load_config({"method": "fedmae"}).model == "vit-base"
    assert registry.load_config({"method": "flbt"}).model == "resnet50"
    assert registry.load_config({"method": "fedmae", "model": "vit-micro"}).model == "vit-micro"
    with pytest.raises(ConfigError, match="method 'fedmae' cannot train model 'resnet18'.*vit-base"):
        registry.load_config({"method": "fedmae", "model": "resnet18"})


def test_every_methods_default_model_builds_and_fedmae_pretrains_it():
    import torch

    from fedderm.mae import build_mae
    from fedderm.models import create_model

    for name in sorted({m.model for m in registry.METHODS.values()}):
        out = create_model(name, num_classes=3, image_size=32)(torch.zeros(2, 3, 32, 32))
        assert out.shape == (2, 3)
    cfg = registry.load_config(
        {
            "method": "fedmae",
            "image-size": 32,
            "fedmae.decoder-embed-dim": 32,
            "fedmae.decoder-depth": 1,
            "fedmae.decoder-num-heads": 2,
        }
    )
    loss = build_mae(cfg)(torch.rand(2, 3, 32, 32))[0]
    assert cfg.model == "vit-base" and torch.isfinite(loss)


def test_requires_python_covers_what_flwr_needs():
    with open(ROOT / "pyproject.toml", "rb") as f:
        ours = tomllib.load(f)["project"]["requires-python"]
    need = importlib.metadata.metadata("flwr")["Requires-Python"]
    low = lambda spec: tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))  # noqa: E731
    assert low(ours) >= low(need), (ours, need)


def test_resume_warning_lists_only_the_keys_the_user_changed(tmp_path, caplog):
    folder = tmp_path / "run"
    folder.mkdir()
    saved = {**registry.load_config({"lr": 0.5}).to_flat(), "preset": "", "overrides": {"lr": 0.5}}
    (folder / "config.json").write_text(json.dumps(saved))
    fused = {**registry.load_config({}).to_flat(), "resume": str(folder), "seed": 7}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        cfg = server_app.resolve_config(fused, {"resume": str(folder), "seed": 7})
    assert cfg.lr == 0.5 and cfg.seed == 0
    warned = [r.getMessage() for r in caplog.records if "resume: ignoring" in r.getMessage()]
    assert len(warned) == 1 and "seed=7" in warned[0] and "lr" not in warned[0]


TINY = (
    'model="tiny-cnn"\nimage-size = 16\nsynthetic-per-class = 30\nnum-server-rounds = 3\n'
    "local-epochs = 2\nbatch-size = 8\n"
)


@pytest.mark.federation
def test_sigint_in_round_2_keeps_a_checkpoint_exits_130_and_resume_equals_the_full_run(
    tmp_path, in_process, capfd, monkeypatch
):
    """Ctrl-C on a Ray simulation (``sim.py`` as a user runs it) in round 2, then ``resume``: the
    same rounds, best round and final metrics as an uninterrupted run.  The uninterrupted run and
    the resume run in this process (bench/loop_grid.py), which computes what Ray's run computes."""
    import sim
    from fedderm import console

    monkeypatch.setattr(console, "stop_on_signals", lambda report: None)  # pytest keeps its own handlers
    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY)
    common = f'output-dir="{tmp_path}" cache-dir="{tmp_path / "cache"}"'
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "sim.py"), "--run-config", str(preset), f'{common} run-name="cut"'],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    cut = tmp_path / "cut"
    deadline = time.monotonic() + 300
    while not (cut / "checkpoint-round-1.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "resume with" in err and "Traceback" not in err + out and "\x1b[" not in err + out
    assert (cut / "checkpoint-round-1.pt").exists() and not (cut / "model.pt").exists()
    assert not (cut / "checkpoint-round-3.pt").exists()
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGINT" in summary["error"]
    config = json.loads((cut / "config.json").read_text())
    assert config["preset"] == str(preset) and config["overrides"]["run-name"] == "cut"
    assert config["model"] == "tiny-cnn" and config["num-server-rounds"] == 3

    capfd.readouterr()
    assert sim.main(["--run-config", str(preset), f'{common} run-name="full"']) in (0, None)
    console = "".join(capfd.readouterr())
    assert "Traceback" not in console and "\x1b[" not in console
    lines = [line for line in console.strip().splitlines() if not _a_wait(line)]
    assert len(lines) <= 3 * 4 + 25, console  # rounds 0-3, start and final table
    assert sim.main(["--run-config", f'resume="{cut}"']) in (0, None)
    assert "resume: ignoring" not in "".join(capfd.readouterr())
    a, b = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "full", cut))
    assert b["status"] == "done" and a["final"] == b["final"] and a["rounds"] == b["rounds"]
    assert a["best_round"] == b["best_round"]


def test_an_image_above_the_decode_limit_is_named(tmp_path, monkeypatch):
    from PIL import Image

    from fedderm.data import DataError, sources

    path = tmp_path / "scan.png"
    Image.new("RGB", (120, 100)).save(path)
    assert sources._read_image(path, 16).shape == (16, 16, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)  # 12,000 px > 2 × 4,000
    with pytest.raises(DataError, match=r"scan.png has more than 8,000 pixels, fedderm's decode limit"):
        sources._read_image(path, 16)


def _a_wait(line: str) -> bool:
    """A progress line a slow machine adds while it waits (for Ray's clients to connect, for replies)."""
    return "clients replied" in line or "waiting for clients:" in line


@pytest.mark.federation
def test_a_failed_run_exits_non_zero_with_one_line_and_its_folder_records_why(tmp_path):
    # a failure inside the ServerApp, after the run folder exists (random-init has nothing to pre-train)
    out = _sim(
        "--run-config",
        f'method="random-init" finetune="none" model="tiny-cnn" image-size=16 '
        f'synthetic-per-class=8 output-dir="{tmp_path}" cache-dir="{tmp_path / "c"}" run-name="bad"',
    )
    assert out.returncode == 2
    console = out.stdout + out.stderr
    lines = [line for line in console.splitlines() if not _a_wait(line)]
    assert "Traceback" not in console and "\x1b[" not in console and len(lines) <= 8, console
    assert re.search(r"^error: method 'random-init' has no pre-training", out.stderr, re.M), out.stderr
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert summary["status"] == "failed" and "random-init" in summary["error"] and summary["final"] is None
