"""Leakage audit of the feature relay (fedclf.leakage-audit): the membership attack,
the relay bank's image ids, the switch in a FedCLF run, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import registry
from fedderm.config import ConfigError
from fedderm.leakage import membership_auc, nearest_distance
from fedderm.moco import FeatureQueue


def test_feature_queue_keeps_the_image_id_of_every_row_through_wraparound_and_restore():
    q = FeatureQueue(4, 2)
    q.enqueue(torch.arange(6.0).reshape(3, 2), ids=torch.tensor([10, 11, 12]))
    q.enqueue(torch.full((1, 2), 9.0))  # no ids: unknown (-1), e.g. remote features
    q.enqueue(torch.full((2, 2), 7.0), ids=torch.tensor([20, 21]))  # wraps around
    assert q.ordered_ids().tolist() == [12, -1, 20, 21]
    assert q.ordered()[:, 0].tolist() == [4.0, 9.0, 7.0, 7.0]
    # image_ids() follows features()' row order
    assert q.image_ids().tolist() == [20, 21, 12, -1]
    assert q.features()[:, 0].tolist() == [7.0, 7.0, 4.0, 9.0]
    restored = FeatureQueue(4, 2, q.ordered(), ids=q.ordered_ids())
    assert torch.equal(restored.ordered(), q.ordered())
    assert torch.equal(restored.ordered_ids(), q.ordered_ids())


def test_membership_auc_is_one_for_exact_features_and_chance_for_unrelated_ones():
    gen = torch.Generator().manual_seed(0)
    members = F.normalize(torch.randn(200, 32, generator=gen), dim=1)
    non_members = F.normalize(torch.randn(200, 32, generator=gen), dim=1)
    assert nearest_distance(members, members).max() == pytest.approx(0.0, abs=1e-3)
    assert membership_auc(members, non_members, members) == 1.0
    unrelated = F.normalize(torch.randn(200, 32, generator=gen), dim=1)
    assert abs(membership_auc(members, non_members, unrelated) - 0.5) < 0.1
    with pytest.raises(ValueError, match="non-members"):
        membership_auc(members, non_members[:0], members)


@pytest.mark.parametrize(
    "raw,key",
    [
        ({"fedclf.leakage-audit": True, "fedclf.feature-sharing": False}, "fedclf.leakage-audit"),
        ({"fedclf.leakage-audit": "yes"}, "fedclf.leakage-audit"),
        ({"fedclf.leakage-views": -1}, "fedclf.leakage-views"),
        ({"fedclf.leakage-views": 1.5}, "fedclf.leakage-views"),
        ({"fedclf.leakage-non-members": -5}, "fedclf.leakage-non-members"),
        ({"fedclf.leakage-non-members": 0.5}, "fedclf.leakage-non-members"),
    ],
)
def test_bad_audit_settings_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        registry.load_config({"method": "fedclf", **raw})


def _null_se(members: int, non_members: int) -> float:
    """Standard deviation of the ROC-AUC of a score independent of membership (Mann-Whitney)."""
    return float(np.sqrt((members + non_members + 1) / (12 * members * non_members)))


# A run built to leak (docs/privacy.md "A run built to leak"): about 55 training images per client and
# K = 512, so every member is about 10 times in an upload; 10 local epochs of SGD (as
# bench/leakage_encoders.py); one colour cast for all images (synthetic-sites = 1); 32 views; a seeded
# sample of 270 held-out images as non-members (fedclf.leakage-non-members, to keep the audit cheap).
LEAKY_RUN = {
    "method": "fedclf",
    "dataset": "digits",
    "partition": "iid",
    "synthetic-sites": 1,
    "val-fraction": 0.47,
    "test-fraction": 0.47,
    "model": "tiny-cnn",
    "image-size": 16,
    "num-server-rounds": 3,
    "local-epochs": 10,
    "batch-size": 64,
    "optimizer": "sgd",
    "lr": 0.03,
    "momentum": 0.9,
    "weight-decay": 0.0,
    "lr-schedule": "constant",
    "seed": 0,
    "fedclf.queue-size": 512,
    "fedclf.leakage-audit": True,
    "fedclf.leakage-views": 32,
    "fedclf.leakage-non-members": 270,
    "fedclf.relay-clip": 1.0,
    "insecure-reproducible-noise": True,  # the measured table's σ = 8 rows repeat to the digit
    "tensorboard": False,
}


def leaky_run(tmp_path, sigma: float, **overrides) -> tuple[list[dict], list[dict]]:
    """LEAKY_RUN's pre-training on a FakeGrid (2 clients, in-process) at noise multiplier ``sigma``:
    (the leakage-audit rounds, summary.json's relay_privacy)."""
    from fake_grid import FakeGrid

    from fedderm.results import RunRecorder
    from strategies import fedclf as fedclf_strategy
    from strategies.finetune import pretrain

    rc = {
        **LEAKY_RUN,
        "fedclf.relay-noise-multiplier": sigma,
        "cache-dir": str(tmp_path / "cache"),
        "output-dir": str(tmp_path / "out"),
        **overrides,
    }
    cfg = registry.load_config(rc)
    rec = RunRecorder(tmp_path / f"s{sigma}", cfg.method, cfg.to_flat())
    strategy = fedclf_strategy.build_strategy(cfg, rec)
    pretrain(strategy, FakeGrid(rc, 2), fedclf_strategy.initial_moco(cfg))
    return [r for r in rec.rounds if r["split"] == "leakage-audit"], rec.extra["relay_privacy"]


def test_attack_auc_clearly_above_chance_without_noise_and_at_chance_with_large_sigma(tmp_path):
    """On a tiny real run: round 3's audit (the upload made in round 2, the
    global model after round 2) has mean AUC over the 2 clients > 0.5 + 3 null sd of that mean at
    σ = 0, and within 3 null sd of 0.5 at σ = 8; ε is ∞ at σ = 0, finite at σ = 8 and the
    accountant's for the releases counted."""
    from fedderm.relay_privacy import relay_epsilon

    results = {}
    for sigma in (0.0, 8.0):
        audits, privacy = leaky_run(tmp_path, sigma)
        assert [a["round"] for a in audits] == [1, 2, 3]
        last = audits[-1]
        assert set(last["per_client"]) == {"0", "1"}
        for m in last["per_client"].values():
            assert 45 <= m["members"] <= 65 and m["non-members"] == 270
        # null sd of the mean of 2 independent client AUCs
        se = np.sqrt(sum(_null_se(m["members"], m["non-members"]) ** 2 for m in last["per_client"].values()))
        se /= 2
        results[sigma] = (last["metrics"]["auc"], se, privacy[-1])
        print(sigma, {k: round(m["auc"], 3) for k, m in last["per_client"].items()}, results[sigma][:2])
    (auc0, se0, p0), (auc8, se8, p8) = results[0.0], results[8.0]
    # measured: 0.660 at σ = 0 and 0.558 at σ = 8 (seed 0); seeds 1-3: 0.655 / 0.629 / 0.635 and
    # 0.498 / 0.519 / 0.494; null sd of the mean 0.030 (docs/privacy.md "A run built to leak")
    assert auc0 > 0.5 + 3 * se0
    assert abs(auc8 - 0.5) < 3 * se8
    assert all(e == float("inf") for e in p0["epsilon"].values())
    for pid, e in p8["epsilon"].items():
        assert e == pytest.approx(relay_epsilon(8.0, p8["releases"][pid], 1e-5))
        assert 0 < e < 10


def test_audit_detects_leakage_without_noise_and_none_with_large_sigma():
    """The attack itself (fedderm.leakage.audit, a MoCo key encoder, digits): relayed features that
    are the members' own features are found (AUC > 0.5 + 3 null sd; 1.0 measured); with σ = 8 the
    AUC is within 3 null sd of 0.5."""
    from sklearn.datasets import load_digits

    from fedderm.leakage import audit, encode_candidates
    from fedderm.moco import build_moco
    from fedderm.relay_privacy import privatise

    x, _ = load_digits(return_X_y=True)
    images = torch.from_numpy(x.reshape(-1, 1, 8, 8) * (255 / 16)).float()
    images = F.interpolate(images, size=16, mode="bilinear").round().to(torch.uint8).repeat(1, 3, 1, 1)
    members, non_members = images[:300], images[300:600]
    torch.manual_seed(0)
    model = build_moco("tiny-cnn", 16)
    own = encode_candidates(model, torch.cat([members, non_members]), batch_size=600)[:300]
    se = _null_se(300, 300)
    exact = privatise(own, 1.0, 0.0)
    noisy = privatise(own, 1.0, 8.0, insecure_seed=1)  # seeded: the measured AUCs repeat
    assert audit(model, members, non_members, exact, batch_size=600) > 0.5 + 3 * se
    assert abs(audit(model, members, non_members, noisy, batch_size=600) - 0.5) < 3 * se
    # fedclf.leakage-views: the smallest distance over the plain image and 4 augmented views
    assert audit(model, members, non_members, exact, views=4, batch_size=600) == 1.0
    with_views = audit(model, members, non_members, noisy, views=4, batch_size=600, seed=3)
    assert abs(with_views - 0.5) < 3 * se
    assert audit(model, members, non_members, noisy, views=4, batch_size=600, seed=3) == with_views
    assert audit(model, members, non_members, noisy, views=4, batch_size=600, seed=4) != with_views
