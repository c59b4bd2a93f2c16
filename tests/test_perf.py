"""Performance fixes that change behaviour: polling, partition cache."""

import numpy as np
import pytest

import registry
from fedderm import data


def test_fast_poll_grid_polls_the_in_memory_grid_more_often():
    from strategies.fastpoll import IN_MEMORY_POLL_INTERVAL, POLL_INTERVAL, FastPollGrid

    class InMemoryGrid:  # stands for Flower's simulation grid (fedderm.flower_private.grid_kind)
        fedderm_grid_kind = "simulation"

    class HttpGrid:
        fedderm_grid_kind = "deployment"

    assert FastPollGrid(InMemoryGrid()).poll_interval == IN_MEMORY_POLL_INTERVAL < POLL_INTERVAL
    assert FastPollGrid(HttpGrid()).poll_interval == POLL_INTERVAL
    assert FastPollGrid(HttpGrid(), poll_interval=0.5).poll_interval == 0.5


def test_every_client_of_a_process_reuses_one_partition_of_the_pool(tmp_path, monkeypatch):
    cfg = registry.load_config(
        {"synthetic-per-class": 4, "image-size": 16, "partition": "source", "cache-dir": str(tmp_path)}
    )  # one site per client
    calls = []
    real = data.partition_indices
    monkeypatch.setattr(data, "partition_indices", lambda *a, **k: calls.append(a) or real(*a, **k))
    clients = [data.load_client_data(cfg, p, 5) for p in range(5)]
    assert len(calls) == 1  # not once per client
    pool = clients[0].pool
    fresh = real("source", pool.labels, 5, seed=cfg.seed, sites=pool.sites, site_names=pool.site_names)
    for p, client in enumerate(clients):
        s = client.split
        assert np.array_equal(np.sort(np.concatenate([s.train, s.val, s.test])), fresh[p])
    other_seed = registry.load_config({**cfg.to_flat(), "seed": 1})
    data.load_client_data(other_seed, 0, 5)
    assert len(calls) == 2  # another seed is another partition


def test_methods_bench_counts_overlapping_loops_once_and_splits_rounds_by_stage():
    """bench/methods.py: 'in local loops' is the union of the clients' loop intervals inside a round."""
    from bench.methods import per_stage, union

    assert union([(0, 2), (1, 3), (5, 6)], 0, 10) == 4  # two parallel clients overlap in [1, 2)
    assert union([(0, 2), (1, 3), (5, 6)], 1.5, 5.5) == 2  # clipped to the window
    assert union([], 0, 1) == 0
    ends = {
        ("pretrain", 1): 10.0,
        ("pretrain", 2): 12.0,
        ("pretrain", 3): 15.0,
        ("finetune", 0): 16.0,
        ("finetune", 1): 18.0,
        ("finetune", 2): 19.0,
    }
    work = [(10.5, 11.5), (11.0, 11.8), (12.0, 14.0)]
    waits = [(10.1, 11.9), (12.0, 14.5), (18.0, 18.9)]
    out = per_stage(ends, work, waits)
    assert list(out) == ["pretrain", "finetune"]  # in the order they ran; round 1 of each left out
    # rounds 2 (10 -> 12: loops 1.3, waiting 1.8) and 3 (12 -> 15: loops 2, waiting 2.5), median = mean of two
    assert out["pretrain"]["rounds"] == 2
    assert np.allclose(
        [out["pretrain"][k] for k in ("round", "loops", "outside", "server")], [2.5, 1.65, 0.85, 0.35]
    )
    assert out["finetune"]["rounds"] == 1 and np.isclose(out["finetune"]["server"], 0.1)


def test_the_apps_start_without_scikit_learn():
    """scikit-learn (with scipy and pandas, ~1.4 s to import) is loaded only when metrics are computed."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, server_app, client_app; print(sorted(m for m in ('sklearn', 'scipy', 'pandas') if m in sys.modules))"
    out = (
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert out == "[]"


def test_a_fresh_client_app_process_imports_only_what_a_fedavg_message_needs(tmp_path):
    """Stock Flower starts a new ClientApp process for every message.  ``import client_app`` loads
    no torchvision (whose import pulls in torchvision.models and torch._dynamo), timm, transformers,
    scikit-learn or PEFT, and no method's or shared stage's ``clients`` module; one fedavg train
    message (tiny CNN) through the whole ClientApp is then answered without an error, and without
    torchvision, timm or transformers."""
    from pathlib import Path

    from bench import cold_start

    kind = cold_start.capture("fedavg", tmp_path / "m.pkl", **{"output-dir": str(tmp_path / "runs")})
    assert kind == "train"
    out = cold_start.message_seconds(Path(__file__).resolve().parents[1], tmp_path / "m.pkl")
    assert out["at import"] == ["clients.audit", "clients.common", "clients.state", "clients.transport"]
    assert out["error"] is None and 0 < out["import"] <= out["handler"] <= out["reply"]
    assert not {"torchvision", "timm", "transformers"} & set(out["libraries"]), out["libraries"]


def test_the_shared_client_stages_route_to_the_modules_that_handle_them():
    """``client_app.SHARED_CLIENTS`` names, for each shared message type, the module whose
    ``HANDLERS`` handles it, and a method's own handler comes first."""
    import importlib

    import client_app
    import registry

    for kind, module in client_app.SHARED_CLIENTS.items():
        assert kind in importlib.import_module(module).HANDLERS
        assert client_app.handler("fedavg", kind) is importlib.import_module(module).HANDLERS[kind]
    fedavg = importlib.import_module(registry.get_method("fedavg").client)
    assert client_app.handler("fedavg", "train") is fedavg.HANDLERS["train"]
    with pytest.raises(ValueError, match="has no client handler for message type 'train.gan'.*train.holdout"):
        client_app.handler("fedavg", "train.gan")


def test_ring_latency_bench_runs_as_the_file_the_issue_names(tmp_path):
    """``python bench/ring_latency.py`` (not only ``python -m bench.ring_latency``) finds the
    checkout's ``deploy`` and ``bench`` packages from any folder, without PYTHONPATH."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "ring_latency.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--launcher" in out.stdout and "ring" in out.stdout.lower()
