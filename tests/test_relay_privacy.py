"""Private feature relay (fedclf.relay-*): clipping, noise, accounting, bad input."""

import json
import math

import numpy as np
import pytest
import torch

import registry
import sim
from fedderm.config import ConfigError
from fedderm.relay_privacy import privatise, relay_epsilon, releases_per_upload


def test_clipping_and_noise():
    x = torch.randn(2000, 16) * 3
    clipped = privatise(x, clip=1.5, noise_multiplier=0.0)
    assert clipped.norm(dim=1).max() <= 1.5 + 1e-5
    small = x / x.norm(dim=1, keepdim=True)  # norm 1 <= C: unchanged
    assert torch.allclose(privatise(small, 1.5, 0.0), small)
    noisy, again = privatise(small, clip=2.0, noise_multiplier=0.5), privatise(small, 2.0, 0.5)
    for got in (noisy, again):
        assert (got - small).std().item() == pytest.approx(1.0, rel=0.03)  # sigma * C
        # the mean of 32,000 N(0, 1) draws has SD 1/sqrt(32,000) = 0.0056: six SDs never fail by chance
        assert (got - small).mean().abs().item() < 6 / (small.numel() ** 0.5)
    # fresh noise from the OS's CSPRNG every call: the two draws are uncorrelated (r of 32,000
    # independent pairs has SD 0.0056; six SDs never fail by chance, the same noise gives r = 1)
    pair = torch.stack([(noisy - small).flatten(), (again - small).flatten()])
    assert torch.corrcoef(pair)[0, 1].abs().item() < 6 / (small.numel() ** 0.5)
    seeded = privatise(small, 2.0, 0.5, insecure_seed=1)  # insecure-reproducible-noise only
    assert (seeded - small).std().item() == pytest.approx(1.0, rel=0.03)
    assert torch.equal(seeded, privatise(small, 2.0, 0.5, insecure_seed=1))


@pytest.mark.parametrize("k,n", [(16, 40), (100, 30), (64, 64), (1024, 100), (5, 3)])
def test_releases_bound_holds_for_any_window_of_the_key_stream(k, n):
    """The newest K keys of a stream of shuffled epochs hold one image at most the bound's times,
    and some window reaches it (the bound is tight)."""
    rng = np.random.default_rng(0)
    stream = np.concatenate([rng.permutation(n) for _ in range(k // n + 4)])
    worst = max(np.bincount(stream[i : i + k], minlength=n).max() for i in range(len(stream) - k + 1))
    assert worst <= releases_per_upload(k, n)
    assert worst >= releases_per_upload(k, n) - 1


def test_epsilon_decreases_with_sigma_and_matches_opacus():
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    from opacus.accountants.rdp import RDPAccountant

    eps = [relay_epsilon(s, 30, 1e-5) for s in (0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(eps, eps[1:]))
    assert relay_epsilon(0.0, 30, 1e-5) == math.inf and relay_epsilon(1.0, 0, 1e-5) == 0.0
    for sigma in (0.5, 1.0, 2.0, 4.0):
        orders = RDPAccountant.DEFAULT_ALPHAS
        rdp = compute_rdp(q=1.0, noise_multiplier=sigma, steps=30, orders=orders)
        expected, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
        assert relay_epsilon(sigma, 30, 1e-5) == pytest.approx(expected, rel=1e-12)
    # the Gaussian mechanism once at sigma = 1: epsilon of a few units at delta = 1e-5
    assert 3 < relay_epsilon(1.0, 1, 1e-5) < 6


@pytest.mark.parametrize(
    "raw,key",
    [
        ({"fedclf.relay-noise-multiplier": -1.0, "fedclf.relay-clip": 1.0}, "fedclf.relay-noise-multiplier"),
        ({"fedclf.relay-clip": -0.5}, "fedclf.relay-clip"),
        ({"fedclf.relay-delta": 1.0}, "fedclf.relay-delta"),
        ({"fedclf.relay-delta": 0.0}, "fedclf.relay-delta"),
        ({"fedclf.relay-noise-multiplier": 1.0}, "fedclf.relay-clip"),  # noise needs a clip
    ],
)
def test_bad_relay_settings_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        registry.load_config({"method": "fedclf", **raw})


def test_fedclf_run_reports_epsilon_per_client_after_every_round(in_process, tmp_path):
    run_dir = sim.simulate(
        registry.smallest_run(
            "fedclf",
            **{
                "num-server-rounds": 2,
                "fedclf.queue-size": 16,
                "finetune": "none",
                "fedclf.relay-clip": 1.0,
                "fedclf.relay-noise-multiplier": 2.0,
                "output-dir": str(tmp_path),
                "cache-dir": str(tmp_path / "cache"),
                "run-name": "dp",
            },
        ),
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    entries = summary["relay_privacy"]
    assert [e["round"] for e in entries] == [0, 1, 2]
    per_upload = {
        pid: releases_per_upload(16, sum(c["train"].values()))
        for pid, c in summary["classes"]["counts"].items()
    }
    for i, e in enumerate(entries):
        assert set(e["epsilon"]) == {"0", "1"}
        for pid, eps in e["epsilon"].items():
            assert e["releases"][pid] == (i + 1) * per_upload[pid]
            assert eps == pytest.approx(relay_epsilon(2.0, (i + 1) * per_upload[pid], 1e-5))
    assert entries[0]["epsilon"]["0"] < entries[1]["epsilon"]["0"] < entries[2]["epsilon"]["0"]
