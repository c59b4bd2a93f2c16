from collections import Counter

import pytest


@pytest.fixture(autouse=True)
def _cpu_threads():
    """Keep tests deterministic and polite on 2 cores."""
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture
def in_process(monkeypatch):
    """``sim.simulate`` (and the sweeps and commands built on it) run the ServerApp and ClientApps in
    this process over ``bench/loop_grid.py``'s grid instead of starting Ray: for tests of what a run
    computes and records, where the Ray path adds nothing (``tests/test_simulation.py`` runs it)."""
    import sim
    from bench.loop_grid import simulate

    monkeypatch.setattr(sim, "simulate", simulate)


def pytest_collection_modifyitems(config, items):
    """Test modules with the most ``federation`` tests first (stable order otherwise): with ``--dist
    loadfile`` and ``--no-loadscope-reorder`` the workers start on the long modules at once instead
    of ending the run on them."""
    federations = Counter(item.path for item in items if item.get_closest_marker("federation"))
    items.sort(key=lambda item: -federations[item.path])
