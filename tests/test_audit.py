"""Outgoing-message audit: for every method, everything a client sends during a short run holds
only the record keys the method declares and no array derived from the client's raw images.

Each run goes through fedderm's ServerApp and ClientApp (with the audit mod) in this process over
the in-memory grid of ``bench/loop_grid.py``: the records a client sends are those of its reply,
whatever carries them.  The Ray simulation path is run by ``tests/test_simulation.py``."""

import hashlib
import json

import numpy as np
import pytest
import torch

import registry
from bench.loop_grid import run_app
from fedderm.data import load_pool
from fedderm.train import to_input

# The ssl-flbt run also exercises FID selection of the pseudo images.
EXTRA: dict[str, dict] = {"ssl-flbt": {"ssl.fid-select": True, "ssl.fid-checkpoints": 2}}


def _image_hashes(images: torch.Tensor) -> set[str]:
    """SHA-256 of every image as raw uint8 and as the normalised float32 the models see."""
    hashes = set()
    for view in (images.numpy(), to_input(images, torch.device("cpu")).numpy().astype(np.float32)):
        for row in view.reshape(len(images), -1):
            hashes.add(hashlib.sha256(np.ascontiguousarray(row).tobytes()).hexdigest())
    return hashes


def _rows(values: np.ndarray, row_size: int) -> list[np.ndarray]:
    if values.size == 0 or values.size % row_size:
        return []
    return [np.ascontiguousarray(r) for r in values.reshape(-1, row_size)]


@pytest.mark.parametrize("method", sorted(registry.METHODS))
def test_clients_send_only_declared_records_and_no_images(method, tmp_path, monkeypatch):
    audit = tmp_path / "audit"
    monkeypatch.setenv("FEDDERM_AUDIT_DIR", str(audit))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # client state, as a deployment keeps it
    overrides = registry.smallest_run(
        method, **{"output-dir": str(tmp_path), "cache-dir": str(tmp_path / "c")}, **EXTRA.get(method, {})
    )
    run_app(overrides, num_clients=2)

    cfg = registry.load_config(overrides)
    pool = load_pool(
        cfg.dataset,
        cfg.data_path,
        image_size=cfg.image_size,
        seed=cfg.seed,
        num_partitions=2,
        synthetic_sites=cfg.synthetic_sites,
        synthetic_per_class=cfg.synthetic_per_class,
        cache_dir=cfg.cache_path,
    )
    images = _image_hashes(pool.images)
    row = 3 * cfg.image_size**2
    allowed = set(registry.get_method(method).sends) | {"info"}
    entries = [
        json.loads(line) for f in sorted(audit.glob("audit-*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert {e["partition-id"] for e in entries} == {0, 1}
    assert any(e["message_type"].startswith("train") for e in entries)
    for entry in entries:
        assert set(entry["records"]) <= allowed, (entry["message_type"], set(entry["records"]) - allowed)
        arrays = np.load(audit / entry["arrays_file"])
        for name in arrays.files:
            values = arrays[name]
            for candidate in (values, values.astype(np.float32)):
                for r in _rows(candidate, row):
                    assert hashlib.sha256(r.tobytes()).hexdigest() not in images, f"{name} holds an image"
