"""End to end through sim.py (Flower simulation runtime): the 004 methods on the embedded data."""

import json

import pytest
import torch

import registry
import sim
from fedderm.flbt import batchnorm_keys
from fedderm.models import create_model

FAST = {
    "model": "tiny-cnn",
    "image-size": 32,
    "synthetic-per-class": 12,
    "num-server-rounds": 1,
    "local-epochs": 1,
    "batch-size": 16,
    "lr": 0.01,
    "optimizer": "sgd",
}


def _run(tmp_path, name, num_supernodes=2, **overrides):
    run_dir = sim.simulate(
        {
            **FAST,
            "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "cache"),
            "run-name": name,
            **overrides,
        },
        num_supernodes=num_supernodes,
    )
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_ssl_flbt_end_to_end_on_synthetic_centres(in_process, tmp_path):
    run_dir, summary = _run(
        tmp_path,
        "ssl",
        method="ssl-flbt",
        **{"ssl.gan-steps": 10, "ssl.pseudo-per-centre": 16, "ssl.gan-width": 16, "ssl.epochs": 1},
    )
    ssl = summary["ssl"]
    assert ssl["pseudo_images"] == 2 * 16 and set(ssl["gan"]) == {"0", "1"}
    assert ssl["pretrain"]["ssl_mse"] > 0 and ssl["pretrain"]["ssl_ce"] > 0
    # stage 2 started from the pre-trained encoder
    encoder = torch.load(run_dir / "ssl-encoder.pt")
    rounds = [r["round"] for r in summary["rounds"] if r["split"] == "val"]
    assert rounds == [0, 1] and set(summary["final"]["per_client"]) == {"0", "1"}
    assert "ap" in summary["final"] and (run_dir / "pseudo_images.png").stat().st_size > 0
    assert (run_dir / "pr_curve_client0.png").exists() and (run_dir / "pr_curve_client1.png").exists()
    model = torch.load(run_dir / "model.pt")
    assert {f"encoder.{k}" for k in encoder} | {"projector.0.weight", "head.weight"} <= set(model)


@pytest.mark.parametrize("method", ["fedbn", "local"])
def test_fedbn_and_local_end_to_end(in_process, tmp_path, monkeypatch, method):
    """FedBN and single-centre training; the local run also holds centre 2 out of the federation
    (``holdout-centre``, 004 Table XI): it answers the handshake and ``train.holdout`` only, sends
    only metrics and PR curves, and fine-tunes from random weights (``local`` has no global model)."""
    audit = tmp_path / "audit"
    monkeypatch.setenv("FEDDERM_AUDIT_DIR", str(audit))
    extra = {"num_supernodes": 3, "holdout-centre": "2", "holdout-epochs": 2} if method == "local" else {}
    run_dir, summary = _run(tmp_path, method, method=method, **extra)
    final = summary["final"]["per_client"]
    assert set(final) == {"0", "1"} and all(0 <= c["accuracy"] <= 1 for c in final.values())
    if method == "fedbn":  # the global model carries no BatchNorm key
        model = torch.load(run_dir / "model.pt")
        bn = batchnorm_keys(create_model("tiny-cnn", 5, 32))
        assert model and not bn & set(model)
        return
    assert all("best-round" in c for c in final.values())  # each client tested its own best-on-val model
    holdout = summary["holdout"]
    assert (
        holdout["centre"] == "2" and holdout["start"] == "random" and 0 <= holdout["final"]["accuracy"] <= 1
    )
    assert [r["split"] for r in summary["rounds"]].count("holdout-val") == 2
    entries = [json.loads(line) for line in (audit / "audit-2.jsonl").read_text().splitlines()]
    assert [e["message_type"] for e in entries] == ["query.info", "train.holdout"]
    assert set(entries[1]["records"]) <= set(registry.HOLDOUT_SENDS)
    others = [
        json.loads(line) for p in (0, 1) for line in (audit / f"audit-{p}.jsonl").read_text().splitlines()
    ]
    assert others and "train.holdout" not in {e["message_type"] for e in others}
