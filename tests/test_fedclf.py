"""FedCLF (000 §III): the MoCo model and loss, the negatives of Eq. 3–5, the server's feature
relay, and the baselines (FedMoCo, FedSimCLR, Local CL, random init).

Most tests drive the real strategies and client handlers through :class:`FakeGrid` (in-process,
no Ray); one end-to-end test runs ``sim.py``.
"""

import importlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

import registry
import sim
from clients.fedclf import BANK
from clients.state import client_state
from fedderm import moco as moco_module
from fedderm.augment import ContrastiveAugment
from fedderm.moco import FeatureQueue, build_moco, info_nce, moco_round
from fedderm.models import create_model
from fedderm.results import RunRecorder
from fedderm.simclr import nt_xent
from strategies import fedclf as fedclf_strategy
from strategies.fedclf import relay_features
from strategies.finetune import pretrain
from wire import FEATURES, REMOTE

CLASSES = ["a", "b", "c", "d", "e"]
TINY = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "num-server-rounds": 2,
    "local-epochs": 1,
    "batch-size": 8,
    "optimizer": "sgd",
    "lr": 0.03,
    "fedclf.queue-size": 24,
    "finetune-rounds": 1,
    "finetune-epochs": 1,
}


def tiny(tmp_path, **overrides) -> dict:
    return {**TINY, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out"), **overrides}


def recorder(tmp_path, cfg, name="run") -> RunRecorder:
    return RunRecorder(tmp_path / name, cfg.method, cfg.to_flat())


def rows(a: np.ndarray) -> list[bytes]:
    """Each row as bytes: exact multiset comparisons of feature rows."""
    return sorted(bytes(r) for r in np.ascontiguousarray(a))


# ---------------------------------------------------------------------------- loss and model
def test_info_nce_equals_hand_computation():
    """Eq. 1/6: −log exp(q·k⁺/τ) / (exp(q·k⁺/τ) + Σ_n exp(q·n/τ)), mean over the batch."""
    q = torch.tensor([[0.6, 0.8], [1.0, 0.0]])
    k = torch.tensor([[0.8, 0.6], [0.0, 1.0]])
    negatives = torch.tensor([[1.0, 0.0], [0.0, -1.0], [-0.6, 0.8]])
    tau = 0.2
    expected = []
    for qi, ki in zip(q.tolist(), k.tolist()):
        dot = lambda a, b: a[0] * b[0] + a[1] * b[1]  # noqa: E731
        pos = math.exp(dot(qi, ki) / tau)
        neg = sum(math.exp(dot(qi, n) / tau) for n in negatives.tolist())
        expected.append(-math.log(pos / (pos + neg)))
    # by hand for the first row: q·k⁺ = 0.96, q·n = 0.6, −0.8, 0.28
    assert expected[0] == pytest.approx(
        -math.log(math.exp(4.8) / (math.exp(4.8) + math.exp(3) + math.exp(-4) + math.exp(1.4)))
    )
    assert info_nce(q, k, negatives, tau).item() == pytest.approx(sum(expected) / 2, rel=1e-6)


def test_nt_xent_equals_hand_computation():
    z1 = F.normalize(torch.tensor([[1.0, 0.2], [0.1, 1.0]]), dim=1)
    z2 = F.normalize(torch.tensor([[0.9, 0.3], [-0.2, 1.0]]), dim=1)
    tau = 0.5
    z = torch.cat([z1, z2]).tolist()
    total = 0.0
    for i in range(4):
        pos = (i + 2) % 4
        sims = {j: sum(a * b for a, b in zip(z[i], z[j])) / tau for j in range(4) if j != i}
        total += -math.log(math.exp(sims[pos]) / sum(math.exp(s) for s in sims.values()))
    assert nt_xent(z1, z2, tau).item() == pytest.approx(total / 4, rel=1e-6)


def test_moco_model_backbone_transfers_and_state_has_no_queue():
    torch.manual_seed(0)
    model = build_moco("tiny-cnn", 32)
    state = model.state_dict()
    prefixes = {k.split(".")[0] for k in state}
    assert prefixes == {"backbone", "head", "momentum_backbone", "momentum_head"}
    assert not [k for k in state if "queue" in k or "bank" in k or "ptr" in k]
    classifier = create_model("tiny-cnn", 5, 32)
    assert {k[len("backbone.") :] for k in state if k.startswith("backbone.")} == set(
        classifier.backbone.state_dict()
    )
    assert (
        model.head[-1].out_features == 128
        and len([m for m in model.head if isinstance(m, torch.nn.Linear)]) == 2
    )
    x = torch.randn(3, 3, 32, 32)
    assert torch.allclose(model(x).norm(dim=1), torch.ones(3)) and torch.allclose(
        model.keys(x).norm(dim=1), torch.ones(3)
    )
    # the momentum encoder is not trained by gradients, and θ_k ← m θ_k + (1 − m) θ_q
    assert all(not p.requires_grad for p in model.momentum_parameters())
    q0, k0 = (
        model.backbone[0][0].weight.detach().clone(),
        model.momentum_backbone[0][0].weight.detach().clone(),
    )
    with torch.no_grad():
        model.backbone[0][0].weight.add_(1.0)
    model.momentum_update(0.75)
    assert torch.allclose(model.momentum_backbone[0][0].weight, 0.75 * k0 + 0.25 * (q0 + 1.0))


def test_feature_queue_is_fifo_and_restores():
    q = FeatureQueue(4, 1)
    q.enqueue(torch.tensor([[1.0], [2.0], [3.0]]))
    assert len(q) == 3 and q.ordered().flatten().tolist() == [1, 2, 3]
    q.enqueue(torch.tensor([[4.0], [5.0], [6.0]]))  # 1 and 2 (the oldest) are dropped
    assert q.ordered().flatten().tolist() == [3, 4, 5, 6]
    assert sorted(q.features().flatten().tolist()) == [3, 4, 5, 6]
    restored = FeatureQueue(4, 1, q.ordered())
    restored.enqueue(torch.tensor([[7.0]]))
    q.enqueue(torch.tensor([[7.0]]))
    assert restored.ordered().flatten().tolist() == q.ordered().flatten().tolist() == [4, 5, 6, 7]
    q.enqueue(torch.arange(10.0)[:, None])  # more than the capacity: the last 4 stay
    assert q.ordered().flatten().tolist() == [6, 7, 8, 9]


def test_augment_is_seeded_per_image_and_keeps_the_image_without_transforms():
    aug = ContrastiveAugment(16)
    x = torch.rand(6, 3, 16, 16)
    a = aug(x, torch.Generator().manual_seed(1))
    assert a.shape == x.shape and 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, aug(x, torch.Generator().manual_seed(1)))
    assert not torch.equal(a, aug(x, torch.Generator().manual_seed(2)))
    same = x[:1].repeat(6, 1, 1, 1)
    views = aug(same, torch.Generator().manual_seed(3))  # one image, six different views
    assert min((views[i] - views[j]).abs().max() for i in range(6) for j in range(i)) > 1e-3
    identity = ContrastiveAugment(16, crop_scale=(1, 1), crop_ratio=(1, 1), jitter_p=0, gray_p=0, blur_p=0)
    out = identity(x, torch.Generator().manual_seed(0))
    for i in range(6):  # only the flips remain
        assert any(
            torch.allclose(out[i], v, atol=1e-5)
            for v in (x[i], x[i].flip(-1), x[i].flip(-2), x[i].flip(-1, -2))
        )


# ---------------------------------------------------------------------------- negatives (Eq. 3-5)
def _round(local_negatives: bool, feature_sharing: bool = True, monkeypatch=None):
    torch.manual_seed(0)
    model = build_moco("tiny-cnn", 16)
    images = torch.randint(0, 256, (24, 3, 16, 16), dtype=torch.uint8)
    local = FeatureQueue(16, 128, F.normalize(torch.randn(10, 128), dim=1))
    remote = F.normalize(torch.randn(40, 128), dim=1)
    seen_negatives, banks = [], []
    real = moco_module.info_nce

    def spy(q, k, negatives, tau):
        seen_negatives.append(negatives.clone())
        return real(q, k, negatives, tau)

    monkeypatch.setattr(moco_module, "info_nce", spy)
    local_before = local.features()
    moco_round(
        model,
        images,
        local,
        remote=remote if feature_sharing else None,
        feature_sharing=feature_sharing,
        local_negatives=local_negatives,
        queue_size=16,
        temperature=0.2,
        key_momentum=0.9,
        epochs=2,
        batch_size=8,
        lr=0.01,
        seed=3,
        on_batch=lambda q: banks.append(q.features()),
    )
    return remote, local_before, local, seen_negatives, banks


def test_without_local_negatives_the_bank_never_holds_a_local_feature(monkeypatch):
    """Eq. 5: Q_CL starts from Q_r and only remote features are enqueued."""
    remote, local_before, local, seen, banks = _round(local_negatives=False, monkeypatch=monkeypatch)
    allowed = set(rows(remote.numpy()))
    assert len(seen) == 6 and len(banks) == 6  # 3 batches x 2 epochs
    for negatives in [*seen, *banks]:
        assert len(negatives) == 16 and set(rows(negatives.numpy())) <= allowed
    # meanwhile Q_l kept receiving the local keys (what the client shares): 10 + 48 -> the last 16
    assert len(local) == 16 and not set(rows(local.features().numpy())) & allowed
    assert not set(rows(local.features().numpy())) & set(rows(local_before.numpy()))


def test_with_local_negatives_the_bank_mixes_local_and_remote(monkeypatch):
    """Eq. 4: Q_CL starts from Q_l, then local keys and B remote samples are enqueued."""
    remote, local_before, local, seen, banks = _round(local_negatives=True, monkeypatch=monkeypatch)
    assert set(rows(seen[0].numpy())) == set(rows(local_before.numpy()))  # initialised as Q_l
    after_first = banks[0].numpy()  # 10 old + 8 keys + 8 remote -> capacity 16
    remote_rows = set(rows(remote.numpy()))
    in_remote = sum(r in remote_rows for r in rows(after_first))
    assert in_remote == 8
    assert set(rows(local.features().numpy())) & set(rows(banks[-1].numpy()))  # local keys are negatives


def test_fedmoco_negatives_are_the_local_queue(monkeypatch):
    remote, local_before, local, seen, banks = _round(
        local_negatives=False, feature_sharing=False, monkeypatch=monkeypatch
    )
    assert set(rows(banks[-1].numpy())) == set(rows(local.features().numpy()))


def test_remote_only_negatives_need_remote_features():
    model = build_moco("tiny-cnn", 16)
    with pytest.raises(ValueError, match="fedclf.local-negatives"):
        moco_round(
            model,
            torch.zeros(4, 3, 16, 16, dtype=torch.uint8),
            FeatureQueue(4, 128),
            remote=None,
            feature_sharing=True,
            local_negatives=False,
            queue_size=4,
            temperature=0.2,
            key_momentum=0.9,
            epochs=1,
            batch_size=4,
            lr=0.01,
        )


# ---------------------------------------------------------------------------- the relay
def test_relay_gives_each_client_the_others_features_shuffled():
    rng = np.random.default_rng(0)
    uploads = {nid: rng.standard_normal((5, 4)).astype(np.float16) for nid in (11, 22, 33)}
    for dst in uploads:
        got = relay_features(uploads, dst, np.random.default_rng(1))
        concat = np.concatenate([uploads[n] for n in sorted(uploads) if n != dst])
        assert got.dtype == np.float16 and got.shape == (10, 4)
        assert rows(got) == rows(concat)
        assert not set(rows(got)) & set(rows(uploads[dst]))
        assert not np.array_equal(got, concat)  # not in upload order
    assert relay_features({11: uploads[11]}, 11, rng).shape == (0, 4)


def _instruction(nid: int) -> Message:
    return Message(
        RecordDict({"config": ConfigRecord({"server-round": 1})}),
        dst_node_id=nid,
        message_type="train.pretrain",
    )


def _fake_reply(nid: int, pid: int, weights: dict, features: np.ndarray, n: int) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in weights.items()}),
            "metrics": MetricRecord({"num-examples": n, "partition-id": pid, "train_loss": 1.0}),
            FEATURES: ArrayRecord({"features": Array(features)}),
        }
    )
    return Message(content, reply_to=_instruction(nid))


def test_strategy_averages_models_only_and_relays_deidentified_features(tmp_path):
    """Fake replies: FedAvg sees the weights only (weighted by |D_c|); next round every client
    gets one shuffled array of the other clients' features and nothing else."""
    cfg = registry.load_config(tiny(tmp_path, method="fedclf"))
    grid = FakeGrid(tiny(tmp_path, method="fedclf"), 3)
    nodes = grid.get_node_ids()
    strategy = fedclf_strategy.build_strategy(cfg, recorder(tmp_path, cfg))
    rng = np.random.default_rng(0)
    weights = {nid: {"w": np.full((2, 2), float(i + 1), np.float32)} for i, nid in enumerate(nodes)}
    uploads = {nid: rng.standard_normal((6, 128)).astype(np.float16) for nid in nodes}
    sizes = {nid: n for nid, n in zip(nodes, (10, 20, 70))}
    replies = [_fake_reply(nid, i, weights[nid], uploads[nid], sizes[nid]) for i, nid in enumerate(nodes)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert list(arrays.keys()) == ["w"]  # features and queues are not averaged
    expected = (1 * 10 + 2 * 20 + 3 * 70) / 100
    assert np.allclose(arrays["w"].numpy(), expected)
    assert all(FEATURES not in r.content for r in replies)

    messages = strategy.configure_train(2, arrays, ConfigRecord(), grid)
    assert sorted(m.metadata.dst_node_id for m in messages) == sorted(nodes)
    for msg in messages:
        nid = msg.metadata.dst_node_id
        assert set(msg.content.keys()) == {"arrays", "config", REMOTE}
        record = msg.content[REMOTE]
        assert list(record.keys()) == ["features"]  # one array: no per-client grouping, no ids
        got = record["features"].numpy()
        others = np.concatenate([uploads[n] for n in nodes if n != nid])
        assert got.dtype == np.float16 and rows(got) == rows(others)
        assert not set(rows(got)) & set(rows(uploads[nid]))
        assert not np.array_equal(got, others)
        assert not {"node-id", "partition-id", "src"} & set(msg.content["config"].keys())
    # Flower's hook only notes the relay's bytes; the round loop's record step writes them
    assert "feature_relay" not in strategy.recorder.extra
    strategy.record_notes()
    relay = strategy.recorder.extra["feature_relay"]
    assert relay[-1]["received_bytes"] == {
        "client 0": 12 * 128 * 2,
        "client 1": 12 * 128 * 2,
        "client 2": 12 * 128 * 2,
    }


def test_clients_receive_exactly_the_others_features_end_to_end(tmp_path):
    """Real clients through the in-process grid: the initial query, then every round each
    client's remote features = the other clients' latest uploads (float16), never its own."""
    rc = tiny(tmp_path, method="fedclf")
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 3)
    strategy = fedclf_strategy.build_strategy(cfg, recorder(tmp_path, cfg))
    pretrain(strategy, grid, fedclf_strategy.initial_moco(cfg))
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds == ["query.features"] * 3 + ["train.pretrain"] * 6
    latest = {}  # node -> what it uploaded in the previous exchange (query, round 1, round 2)
    for start in (0, 3, 6):
        batch = list(zip(grid.sent, grid.replies))[start : start + 3]
        for msg, reply in batch:
            nid = msg.metadata.dst_node_id
            if msg.metadata.message_type == "train.pretrain":
                got = msg.content[REMOTE]["features"].numpy()
                others = np.concatenate([latest[n] for n in sorted(latest) if n != nid])
                assert rows(got) == rows(others) and not set(rows(got)) & set(rows(latest[nid]))
                assert set(reply.content["arrays"].keys()) == set(build_moco("tiny-cnn", 16).state_dict())
        for msg, reply in batch:
            uploaded = reply.content[FEATURES]["features"].numpy()
            assert uploaded.dtype == np.float16 and uploaded.shape[1] == 128
            latest[msg.metadata.dst_node_id] = uploaded
    # each client keeps its bank (client-only state); uploads are K = 24 features of 128 floats
    for ctx in grid.contexts.values():
        assert tuple(client_state(ctx).tensors(BANK)["features"].shape) == (24, 128)
    assert all(latest[n].shape == (24, 128) for n in latest)


def test_feature_dtype_float32_travels_as_float32(tmp_path):
    rc = tiny(tmp_path, method="fedclf", **{"fedclf.feature-dtype": "float32", "num-server-rounds": 1})
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    pretrain(
        fedclf_strategy.build_strategy(cfg, recorder(tmp_path, cfg)), grid, fedclf_strategy.initial_moco(cfg)
    )
    assert grid.sent[-1].content[REMOTE]["features"].numpy().dtype == np.float32
    assert grid.replies[-1].content[FEATURES]["features"].numpy().dtype == np.float32


def test_fedclf_without_feature_sharing_equals_fedmoco(tmp_path):
    """Same seed, same weights: ``fedclf.feature-sharing=false`` is FedMoCo (and sends no features)."""
    results = {}
    for method, extra in [("fedclf", {"fedclf.feature-sharing": False}), ("fedmoco", {})]:
        rc = tiny(tmp_path, method=method, **extra)
        cfg = registry.load_config(rc)
        grid = FakeGrid(rc, 2)
        module = importlib.import_module(registry.get_method(method).strategy)
        arrays = pretrain(
            module.build_strategy(cfg, recorder(tmp_path, cfg, method)),
            grid,
            fedclf_strategy.initial_moco(cfg),
        )
        assert [m.metadata.message_type for m in grid.sent] == ["train.pretrain"] * 4
        assert all(REMOTE not in m.content for m in grid.sent) and all(
            FEATURES not in r.content for r in grid.replies
        )
        results[method] = arrays.to_torch_state_dict()
    a, b = results["fedclf"], results["fedmoco"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and sharing changes the result (the switch is not a no-op)
    rc = tiny(tmp_path, method="fedclf")
    cfg = registry.load_config(rc)
    shared = pretrain(
        fedclf_strategy.build_strategy(cfg, recorder(tmp_path, cfg, "s")),
        FakeGrid(rc, 2),
        fedclf_strategy.initial_moco(cfg),
    ).to_torch_state_dict()
    assert not torch.equal(shared["backbone.0.0.weight"], a["backbone.0.0.weight"])


# ---------------------------------------------------------------------------- baselines, whole plans
@pytest.mark.parametrize(
    "method,finetune", [("localcl", "local"), ("fedsimclr", "federated"), ("random-init", "federated")]
)
def test_baselines_run_their_plan(tmp_path, method, finetune):
    rc = tiny(tmp_path, method=method, finetune=finetune)
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    rec = recorder(tmp_path, cfg)
    importlib.import_module(registry.get_method(method).strategy).run(grid, cfg, rec, CLASSES)
    pre = [r for r in rec.rounds if r["split"] == "pretrain"]
    assert len(pre) == (0 if method == "random-init" else 2)
    assert all(r["metrics"]["loss"] > 0 for r in pre)
    assert set(rec.final["per_client"]) == {"0", "1"}
    kinds = {m.metadata.message_type for m in grid.sent}
    assert ("train.pretrain" in kinds) == (method != "random-init") and "train.finetune" in kinds
    if method == "localcl":
        # nothing averaged: round 2 carries no weights, clients keep diverging models
        pre_msgs = [m for m in grid.sent if m.metadata.message_type == "train.pretrain"]
        assert [len(m.content["arrays"]) > 0 for m in pre_msgs] == [True, True, False, False]
        own = [
            client_state(ctx).tensors("fedclf-model")["backbone.0.0.weight"].numpy()
            for ctx in grid.contexts.values()
        ]
        assert not np.array_equal(own[0], own[1])
        assert all(FEATURES not in r.content for r in grid.replies)


def test_localcl_finetunes_from_the_clients_own_backbone(tmp_path):
    """The classifier with the initial backbone (round 0, round 1, a test of round 0) gets the
    client's own pre-trained backbone; a fine-tuned (averaged) backbone is used as sent."""
    from clients.localcl import INITIAL, backbone_digest, with_own_backbone

    grid = FakeGrid(tiny(tmp_path, method="localcl"), 1)
    ctx = next(iter(grid.contexts.values()))
    initial = {"backbone.w": np.zeros(2, np.float32), "head.0.weight": np.zeros(1, np.float32)}
    state = client_state(ctx)
    state.put(
        INITIAL, meta={"digest": backbone_digest(ArrayRecord({k: Array(v) for k, v in initial.items()}))}
    )
    state.put("fedclf-model", {"backbone.w": torch.ones(2), "head.0.weight": torch.zeros(1)})

    def instruction(backbone):
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord(
                        {
                            "backbone.w": Array(np.asarray(backbone, np.float32)),
                            "head.weight": Array(np.full(3, 5, np.float32)),
                        }
                    ),
                    "config": ConfigRecord({"server-round": 1}),
                }
            ),
            dst_node_id=1,
            message_type="train.finetune",
        )

    arrays = with_own_backbone(instruction([0, 0]), ctx).content["arrays"]
    assert arrays["backbone.w"].numpy().tolist() == [1, 1]  # the client's own
    assert arrays["head.weight"].numpy().tolist() == [5, 5, 5]  # the server's new head
    arrays = with_own_backbone(instruction([0.5, 0]), ctx).content["arrays"]
    assert arrays["backbone.w"].numpy().tolist() == [0.5, 0]  # fine-tuned weights stay


def test_fedclf_keys_are_validated():
    from fedderm.config import ConfigError

    with pytest.raises(ConfigError, match="fedclf.feature-dtype"):
        registry.load_config({"fedclf.feature-dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="fedclf.momentum"):
        registry.load_config({"fedclf.momentum": 1.0})
    with pytest.raises(ConfigError, match="fedclf.queue-size"):
        registry.load_config({"fedclf.queue-size": 0})


def test_fedclf_pretrain_then_federated_finetune_with_sim(in_process, tmp_path):
    """Must show 2/3: sim.py, FedCLF pre-training -> federated fine-tuning at L = 10 %; the
    summary records the features relayed per client per round."""
    run_dir = sim.simulate(
        {
            **TINY,
            "method": "fedclf",
            "image-size": 32,
            "synthetic-per-class": 20,
            "label-fraction": 0.1,
            "finetune": "federated",
            "finetune-rounds": 2,
            "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "c"),
            "run-name": "r",
        },
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"] if r["split"] == "pretrain"] == [1, 2]
    assert [r["round"] for r in summary["rounds"] if r["split"] == "val"] == [0, 1, 2]
    relay = summary["feature_relay"]
    assert [e["round"] for e in relay] == [1, 2]
    for entry in relay:  # K = 24 features x 128 dims x 2 bytes (float16), from the other client
        assert entry["received_bytes"] == {f"client {i}": 24 * 128 * 2 for i in range(2)}
        assert entry["uploaded_bytes"] == {f"client {i}": 24 * 128 * 2 for i in range(2)}
    assert set(summary["final"]["per_client"]) == {"0", "1"}
    assert torch.load(run_dir / "model.pt")["head.weight"].shape == (5, 128)
    assert "momentum_backbone.0.0.weight" in torch.load(run_dir / "model-pretrained.pt")


def test_presets_and_table_grids_are_valid_run_configs():
    """Every preset resolves; the grids of 000's tables (sweeps/000-fedclf-*.toml) use the
    paper-scale presets' settings, and every row of them is a valid run config."""
    from pathlib import Path

    from fedderm.sweep import load_sweep

    root = Path(__file__).resolve().parents[1]
    presets = sorted((root / "presets").glob("fedclf-*.toml"))
    assert {p.stem for p in presets} == {
        f"fedclf-{t}{s}" for t in ("table1", "table2", "fig6") for s in ("", "-small")
    }
    for preset in presets:
        base = sim.parse_overrides([str(preset)])
        paper_scale = not preset.stem.endswith("-small")
        cfg = registry.load_config(sim.resolved_run_config(base))
        assert cfg.method == "fedclf" and cfg.label_fraction == 0.1
        if paper_scale:  # 000 §V-A
            assert (
                cfg.min_clients,
                cfg.num_server_rounds,
                cfg.batch_size,
                cfg.lr,
                cfg.lr_schedule,
                cfg.local_epochs,
                cfg.model,
                cfg.image_size,
            ) == (10, 100, 128, 0.03, "cosine", 1, "resnet18", 72)
        assert cfg.finetune == ("local" if "table1" in preset.stem else "federated")
        if paper_scale:
            grid = load_sweep(root / "sweeps" / f"000-{preset.stem}.toml", load_config=registry.load_config)
            assert grid.num_supernodes == cfg.min_clients
            shared = {
                k: v
                for k, v in base.items()
                if k not in ("method", "label-fraction")
                and not k.startswith("fedclf.feature")
                and not k.startswith("fedclf.local")
            }
            for run in grid.runs():
                assert {k: run.overrides[k] for k in shared} == shared
    fig6 = load_sweep(root / "sweeps" / "000-fedclf-fig6.toml")
    assert [r.labels["method"] for r in fig6.rows()] == ["W/o FE", "FE", "FE+Neg"]
