"""The federated baselines of paper 003 (Tables VI–VII, Fig. 10b): FedBYOL, FedEMA, FedMoCo-v3 and
Semi-FL — their losses and update rules against hand computations, and their plans through the
real strategies and client handlers (:class:`FakeGrid`, in-process)."""

import importlib
import math

import pytest
import torch
from fake_grid import FakeGrid

import registry
from clients.fedbyol import LOCAL_MODEL, SCALER, divergence_aware_online
from clients.state import client_state
from fedderm.byol import ONLINE_PREFIXES, build_byol, byol_loss, byol_round, regression_loss
from fedderm.fedema import autoscaler, divergence, ema_update, ema_weight
from fedderm.results import RunRecorder
from fedderm.state_store import Snapshot
from strategies.finetune import pretrain

CLASSES = ["a", "b", "c", "d", "e"]
TINY = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "num-server-rounds": 3,
    "local-epochs": 1,
    "batch-size": 8,
    "optimizer": "sgd",
    "lr": 0.03,
    "finetune-rounds": 1,
    "finetune-epochs": 1,
    "byol.hidden-dim": 32,
    "byol.proj-dim": 16,
}


def tiny(tmp_path, **overrides) -> dict:
    return {**TINY, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out"), **overrides}


def recorder(tmp_path, cfg, name="run") -> RunRecorder:
    return RunRecorder(tmp_path / name, cfg.method, cfg.to_flat())


# ---------------------------------------------------------------------------- BYOL
def test_byol_regression_loss_equals_hand_computation():
    """BYOL Eq. 2: ‖q̄ − z̄‖² = 2 − 2⟨q, z⟩/(‖q‖‖z‖): q = (3, 4), z = (4, 3) -> cos = 24/25, loss
    0.08; z = (−3, −4) -> 4.  Unnormalised vectors would give 2 and 100; a wrong sign −0.08."""
    q = torch.tensor([[3.0, 4.0], [3.0, 4.0]])
    z = torch.tensor([[4.0, 3.0], [-3.0, -4.0]])
    assert regression_loss(q, z).tolist() == pytest.approx([2 - 2 * 24 / 25, 4.0])


def test_byol_symmetric_loss_pairs_each_prediction_with_the_other_views_target():
    """Eq. 3: L + L̃ = mean_i [ℓ(q1_i, z2_i) + ℓ(q2_i, z1_i)], never q1 with z1."""
    q1, q2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    z1, z2 = torch.tensor([[0.0, 2.0]]), torch.tensor([[5.0, 0.0]])
    # q1 ∥ z2 and q2 ∥ z1: both terms 0 (paired the other way round the loss would be 4)
    assert byol_loss(q1, q2, z1, z2).item() == pytest.approx(0.0, abs=1e-7)
    z2 = torch.tensor([[1.0, 1.0]])  # ℓ(q1, z2) = 2 − 2/√2
    assert byol_loss(q1, q2, z1, z2).item() == pytest.approx(2 - math.sqrt(2))
    batch = byol_loss(torch.cat([q1, q1]), torch.cat([q2, q2]), torch.cat([z1, z1]), torch.cat([z2, z2]))
    assert batch.item() == pytest.approx(2 - math.sqrt(2))  # a mean over the batch, not a sum


def test_byol_target_is_an_ema_of_the_online_network_and_gets_no_gradient():
    torch.manual_seed(0)
    model = build_byol("tiny-cnn", 16, hidden_dim=8, proj_dim=4)
    online = [p.detach().clone() for p in [*model.backbone.parameters(), *model.projector.parameters()]]
    with torch.no_grad():
        for p in model.target_parameters():
            p.fill_(1.0)
    model.momentum_update(0.9)
    for t, o in zip(model.target_parameters(), online):
        assert torch.allclose(t, 0.9 * torch.ones_like(o) + 0.1 * o)
    assert not any(p.requires_grad for p in model.target_parameters())
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = byol_round(model, images, tau=0.99, epochs=1, batch_size=8, lr=0.05)
    after = model.state_dict()
    assert math.isfinite(metrics["train_loss"]) and 0 <= metrics["train_loss"] <= 8
    for k in before:  # one step: the online weights moved by SGD, the target by the EMA towards them
        if k.startswith("predictor.") and k.endswith("weight"):
            assert not torch.equal(before[k], after[k])
    w = "target_projector.0.weight"
    assert torch.allclose(after[w], 0.99 * before[w] + 0.01 * before["projector.0.weight"], atol=1e-6)


# ---------------------------------------------------------------------------- FedEMA
def test_fedema_update_equals_hand_computation():
    """FedEMA §5: d = ‖W_g − W_k‖ (L2 over the encoder), λ = τ/d, μ = min(λd, 1),
    W ← μ W_k + (1 − μ) W_g."""
    local = {"backbone.w": torch.tensor([1.0, 2.0]), "predictor.w": torch.tensor([4.0])}
    glob = {"backbone.w": torch.tensor([4.0, 6.0]), "predictor.w": torch.tensor([0.0])}
    d = divergence(glob, local, ["backbone.w"])
    assert d == pytest.approx(5.0)  # √(3² + 4²); a squared norm would be 25
    lam = autoscaler(0.7, d)
    assert lam == pytest.approx(0.14) and ema_weight(lam, d) == pytest.approx(0.7)
    assert ema_weight(lam, 10.0) == 1.0 and ema_weight(lam, 1.0) == pytest.approx(0.14)
    new = ema_update(local, glob, 0.7, ["backbone.w", "predictor.w"])
    # μ on the LOCAL model: 0.7·(1, 2) + 0.3·(4, 6) = (1.9, 3.2); 0.7·4 + 0.3·0 = 2.8
    assert new["backbone.w"].tolist() == pytest.approx([1.9, 3.2])
    assert new["predictor.w"].tolist() == pytest.approx([2.8])
    with pytest.raises(ValueError, match="positive divergence"):
        autoscaler(0.7, 0.0)


def test_fedema_client_computes_lambda_once_then_keeps_it():
    cfg = registry.load_config({"method": "fedema", "fedema.tau": 0.7})
    state = Snapshot(None, 0, None, {})
    keys = ["backbone.w", "projector.w", "predictor.w"]
    local = {
        "backbone.w": torch.tensor([0.0, 0.0]),
        "projector.w": torch.tensor([0.0]),
        "predictor.w": torch.tensor([1.0]),
    }
    glob = {
        "backbone.w": torch.tensor([3.0, 0.0]),
        "projector.w": torch.tensor([4.0]),
        "predictor.w": torch.tensor([0.0]),
    }
    online, m = divergence_aware_online(state, local, glob, keys, cfg)
    assert m["fedema-divergence"] == pytest.approx(5.0)  # encoder = backbone + projector, not predictor
    assert m["fedema-lambda"] == pytest.approx(0.14) and m["fedema-mu"] == pytest.approx(0.7)
    assert state.meta(SCALER) == {"lambda": pytest.approx(0.14)}
    assert online["backbone.w"].tolist() == pytest.approx([0.9, 0.0])
    assert online["predictor.w"].tolist() == pytest.approx([0.7])  # the predictor by the same EMA
    glob2 = {**glob, "backbone.w": torch.tensor([0.0, 2.0]), "projector.w": torch.tensor([0.0])}
    _, m2 = divergence_aware_online(state, local, glob2, keys, cfg)
    assert m2["fedema-lambda"] == pytest.approx(0.14) and m2["fedema-mu"] == pytest.approx(0.28)
    fixed = registry.load_config({"method": "fedema", "fedema.lambda": 1.0})
    _, m3 = divergence_aware_online(Snapshot(None, 0, None, {}), local, glob2, keys, fixed)
    assert m3["fedema-mu"] == 1.0  # λ = 1, d = 2: μ = min(2, 1)


@pytest.mark.parametrize("method", ["fedbyol", "fedema"])
def test_byol_methods_send_the_online_network_and_keep_their_own(tmp_path, method):
    rc = tiny(tmp_path, method=method)
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    strategy = importlib.import_module(registry.get_method(method).strategy)
    from strategies.fedbyol import initial_online

    arrays = pretrain(
        strategy.build_strategy(cfg, recorder(tmp_path, cfg)), grid, registry_record(initial_online(cfg))
    )
    assert all(k.startswith(ONLINE_PREFIXES) for k in arrays.keys())
    replies = [r for r in grid.replies if r.metadata.message_type == "train.pretrain"]
    assert len(replies) == 6 and all(set(r.content["arrays"].keys()) == set(arrays.keys()) for r in replies)
    for ctx in grid.contexts.values():
        own = client_state(ctx).tensors(LOCAL_MODEL)
        assert any(k.startswith("target_") for k in own)  # the target network stays on the client
    metrics = [dict(r.content["metrics"]) for r in replies]
    if method == "fedbyol":
        assert not any("fedema-mu" in m for m in metrics)
        return
    by_round = [metrics[i : i + 2] for i in (0, 2, 4)]
    assert not any("fedema-mu" in m for m in by_round[0])  # first participation: the global model
    assert all(m["fedema-mu"] == pytest.approx(0.7) for m in by_round[1])  # the autoscaler: μ = τ
    lam = {m["partition-id"]: m["fedema-lambda"] for m in by_round[1]}
    for m in by_round[2]:
        assert m["fedema-lambda"] == lam[m["partition-id"]]
        assert m["fedema-mu"] == pytest.approx(min(lam[m["partition-id"]] * m["fedema-divergence"], 1.0))


def registry_record(state):
    from wire import to_record

    return to_record(state)


@pytest.mark.parametrize("method", ["fedbyol", "fedema"])
def test_ssl_baselines_run_their_plan(tmp_path, method):
    rc = tiny(tmp_path, method=method, **{"num-server-rounds": 2})
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    rec = recorder(tmp_path, cfg)
    importlib.import_module(registry.get_method(method).strategy).run(grid, cfg, rec, CLASSES)
    pre = [r for r in rec.rounds if r["split"] == "pretrain"]
    assert len(pre) == 2 and all(r["metrics"]["loss"] > 0 for r in pre)
    assert set(rec.final["per_client"]) == {"0", "1"}
    kinds = {m.metadata.message_type for m in grid.sent}
    assert {"train.pretrain", "train.finetune"} <= kinds


# ---------------------------------------------------------------------------- MoCo v3
def test_mocov3_ctr_equals_hand_computation():
    """ctr(q, k) = CE(q̄·k̄ᵀ/τ, arange) · 2τ: with q̄ = k̄ = I (2×2) and τ = 0.5 each row's logits are
    (2, 0) with the positive first: −log(e²/(e² + 1)) = log(1 + e⁻²), times 2τ = 1.  Unnormalised
    inputs (q = diag(2, 3)) give the same; a missing 2τ or a sign flip would not."""
    from fedderm.mocov3 import ctr

    eye = torch.eye(2)
    assert ctr(eye, eye, 0.5).item() == pytest.approx(math.log(1 + math.exp(-2)))
    assert ctr(torch.diag(torch.tensor([2.0, 3.0])), eye, 0.5).item() == pytest.approx(
        math.log(1 + math.exp(-2))
    )
    # τ = 0.2: logits (5, 0), CE log(1 + e⁻⁵), times 0.4
    assert ctr(eye, eye, 0.2).item() == pytest.approx(0.4 * math.log(1 + math.exp(-5)))
    # a 3-image batch, by hand: q = (1,0), (0,1), (0.6,0.8); k = (0.8,0.6), (0,1), (1,0); τ = 0.25
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    k = torch.tensor([[0.8, 0.6], [0.0, 1.0], [1.0, 0.0]])
    rows = [[0.8, 0.0, 1.0], [0.6, 1.0, 0.0], [0.96, 0.8, 0.6]]
    ce = [-math.log(math.exp(r[i] / 0.25) / sum(math.exp(v / 0.25) for v in r)) for i, r in enumerate(rows)]
    assert ctr(q, k, 0.25).item() == pytest.approx(sum(ce) / 3 * 0.5, rel=1e-6)


def test_mocov3_loss_pairs_each_query_with_the_other_views_key():
    from fedderm.mocov3 import ctr, mocov3_loss

    a = torch.eye(2)
    b = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    # view 1 gives a for queries and b for keys, view 2 the reverse: q1 ∥ k2, q2 ∥ k1
    loss = mocov3_loss(a, b, b, a, 0.2)
    assert loss.item() == pytest.approx(2 * ctr(a, a, 0.2).item())
    assert loss.item() < mocov3_loss(a, b, a, b, 0.2).item()  # paired with its own view's key: worse


def test_mocov3_freezes_the_patch_embedding_and_moves_the_momentum_encoder():
    from fedderm.mocov3 import build_mocov3, mocov3_round

    torch.manual_seed(0)
    model = build_mocov3("vit-micro", 16, hidden_dim=16, proj_dim=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    metrics = mocov3_round(model, images, temperature=0.2, key_momentum=0.9, epochs=2, batch_size=8, lr=0.05)
    after = model.state_dict()
    assert math.isfinite(metrics["train_loss"])
    assert torch.equal(before["backbone.patch_embed.proj.weight"], after["backbone.patch_embed.proj.weight"])
    for k in ("backbone.blocks.0.attn.qkv.weight", "momentum_backbone.blocks.0.attn.qkv.weight"):
        assert not torch.equal(before[k], after[k]), k


def test_fedmocov3_runs_its_plan(tmp_path):
    rc = tiny(
        tmp_path,
        method="fedmocov3",
        model="vit-micro",
        **{"num-server-rounds": 2, "mocov3.hidden-dim": 16, "mocov3.proj-dim": 8},
    )
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    rec = recorder(tmp_path, cfg)
    importlib.import_module(registry.get_method("fedmocov3").strategy).run(grid, cfg, rec, CLASSES)
    pre = [r for r in rec.rounds if r["split"] == "pretrain"]
    assert len(pre) == 2 and all(r["metrics"]["loss"] > 0 for r in pre)
    assert set(rec.final["per_client"]) == {"0", "1"}


# ---------------------------------------------------------------------------- Semi-FL
class _FirstPixels(torch.nn.Module):
    """Logits = the first three input values of each image (a model whose outputs we know)."""

    def forward(self, x):
        return x.flatten(1)[:, :3] * 4


def test_semifl_consistency_loss_equals_hand_computation():
    """(1/B) Σ_b 1[max p_b ≥ t] · CE(f(A(u_b)), argmax p_b), with A the identity here: each kept
    term is −log max softmax(f(u_b)); masked terms count in the mean (divided by B, not by the
    number kept)."""
    from fedderm.semifl import consistency_loss

    u = torch.zeros(2, 3, 2, 2, dtype=torch.uint8)
    flat = u.view(2, -1)
    flat[0, :3] = torch.tensor([255, 0, 0])  # a confident pseudo label (class 0)
    flat[1, :3] = torch.tensor([128, 140, 0])  # a hesitant one (class 1)
    logits = (u.flatten(1)[:, :3].float() / 255 - 0.5) / 0.5 * 4
    p = torch.softmax(logits, dim=1).max(dim=1).values
    identity = lambda x, g: x  # noqa: E731
    g = torch.Generator()
    got = consistency_loss(_FirstPixels(), u, identity, g, torch.device("cpu"), threshold=0.0)
    assert got.item() == pytest.approx(float(-torch.log(p).mean()), rel=1e-6)
    t = float(p.min() + p.max()) / 2  # only the more confident image passes
    masked = consistency_loss(_FirstPixels(), u, identity, g, torch.device("cpu"), threshold=t)
    assert masked.item() == pytest.approx(float(-torch.log(p.max())) / 2, rel=1e-4)
    assert got.item() > 0


def test_semifl_supervised_phase_is_plain_cross_entropy_and_the_joint_phase_is_not():
    from fedderm.models import create_model
    from fedderm.semifl import semifl_round
    from fedderm.train import train_supervised

    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    unlabelled = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    kw = dict(epochs=1, batch_size=4, lr=0.05, seed=5)

    def trained(fn, **extra):
        torch.manual_seed(0)
        model = create_model("tiny-cnn", 3, 16)
        fn(model, images, labels, **extra, **kw)
        return model.state_dict()

    plain = trained(train_supervised)
    sup = trained(semifl_round, unlabelled=unlabelled, weight=1.0, threshold=0.0, use_unlabelled=False)
    joint = trained(semifl_round, unlabelled=unlabelled, weight=1.0, threshold=0.0, use_unlabelled=True)
    assert all(torch.equal(plain[k], sup[k]) for k in plain)
    assert not all(torch.equal(plain[k], joint[k]) for k in plain)


def test_semifl_runs_through_the_server_app(tmp_path):
    import json

    from bench.loop_grid import TINY_RUN, run_app

    run = run_app(
        {
            **TINY_RUN,
            "method": "semifl",
            "num-server-rounds": 2,
            "label-fraction": 0.5,
            "cache-dir": str(tmp_path / "c"),
            "output-dir": str(tmp_path / "o"),
        }
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "done" and summary["final"]


# ---------------------------------------------------------------------------- 004's FedSSL-R/S on FedEMA
@pytest.mark.parametrize("tasks,fedema", [("restoration", True), ("simclr", True), ("simclr", False)])
def test_fedssl_pretraining_updates_each_centre_by_fedema(tmp_path, tasks, fedema):
    """004's FedSSL-R/S are defined on FedEMA ([67]): from its second round each centre's network is
    μ·own + (1 − μ)·global, μ = τ at the first update (the autoscaler), then min(λd, 1) with λ kept;
    ``ssl.fedema=false`` is plain FedAvg (no update, no local model kept)."""
    from clients.ssl_flbt import FEDEMA_MODEL
    from strategies import ssl_flbt

    rc = {
        **TINY,
        "method": "ssl-flbt",
        "num-server-rounds": 1,
        "cache-dir": str(tmp_path / "cache"),
        "output-dir": str(tmp_path / "out"),
        "ssl.pretrain": "federated",
        "ssl.tasks": tasks,
        "ssl.finetune": "fedavg",
        "ssl.rounds": 3,
        "ssl.epochs": 1,
        "ssl.fedema": fedema,
    }
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    ssl_flbt.run(grid, cfg, recorder(tmp_path, cfg), CLASSES)
    pre = [dict(r.content["metrics"]) for r in grid.replies if "fedema-mu" in r.content["metrics"]]
    kept = [client_state(ctx).tensors(FEDEMA_MODEL) for ctx in grid.contexts.values()]
    if not fedema:
        assert not pre and kept == [None, None]
        return
    assert len(pre) == 4 and all(k is not None for k in kept)
    assert all(m["fedema-mu"] == pytest.approx(0.7) for m in pre[:2])
    lam = {m["partition-id"]: m["fedema-lambda"] for m in pre[:2]}
    for m in pre[2:]:
        assert m["fedema-lambda"] == lam[m["partition-id"]]
        assert m["fedema-mu"] == pytest.approx(min(lam[m["partition-id"]] * m["fedema-divergence"], 1.0))
