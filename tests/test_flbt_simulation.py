"""End to end through sim.py (Flower simulation runtime): the 004 methods on the embedded data."""

import json

import pytest
import torch

import sim
from fedderm.flbt import batchnorm_keys
from fedderm.models import create_model

FAST = {"model": "tiny-cnn", "image-size": 32, "synthetic-per-class": 12, "num-server-rounds": 1,
        "local-epochs": 1, "batch-size": 16, "lr": 0.01, "optimizer": "sgd"}


def _run(tmp_path, name, **overrides):
    run_dir = sim.simulate({**FAST, "output-dir": str(tmp_path), "cache-dir": str(tmp_path / "cache"),
                            "run-name": name, **overrides}, num_supernodes=2)
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_ssl_flbt_end_to_end_on_synthetic_centres(tmp_path):
    run_dir, summary = _run(tmp_path, "ssl", method="ssl-flbt", **{
        "ssl.gan-steps": 10, "ssl.pseudo-per-centre": 16, "ssl.gan-width": 16, "ssl.epochs": 1})
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
def test_fedbn_and_local_end_to_end(tmp_path, method):
    run_dir, summary = _run(tmp_path, method, method=method)
    final = summary["final"]["per_client"]
    assert set(final) == {"0", "1"} and all(0 <= c["accuracy"] <= 1 for c in final.values())
    if method == "fedbn":  # the global model carries no BatchNorm key
        model = torch.load(run_dir / "model.pt")
        bn = batchnorm_keys(create_model("tiny-cnn", 5, 32))
        assert model and not bn & set(model)
    else:  # each client tested its own best-on-val model
        assert all("best-round" in c for c in final.values())
