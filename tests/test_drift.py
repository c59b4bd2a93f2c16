"""SCAFFOLD and FedDyn (the optimisation baselines of SiFT's Table 1), rounds to target, lr decay."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

import registry
from clients.state import client_state
from fedderm.config import ConfigError
from fedderm.drift import feddyn_server_step, feddyn_train, scaffold_server_control, scaffold_train, trainable
from fedderm.models import create_model
from fedderm.results import RunRecorder
from fedderm.train import round_lr, train_supervised
from strategies.common import rounds_to_target, run_federated
from tests.fake_grid import FakeGrid

PLAIN_SGD = {
    "epochs": 1,
    "batch_size": 4,
    "optimizer": "sgd",
    "momentum": 0.0,
    "weight_decay": 0.0,
    "seed": 3,
}


def _model_and_batch(seed=0):
    torch.manual_seed(seed)
    model = create_model("tiny-cnn", num_classes=3, image_size=16)
    images = torch.randint(0, 255, (4, 3, 16, 16), dtype=torch.uint8)
    return model, images, torch.tensor([0, 1, 2, 0])


def _one_plain_step(lr):
    model, images, labels = _model_and_batch()
    train_supervised(model, images, labels, lr=lr, **PLAIN_SGD)
    return model


def test_scaffold_one_step_is_corrected_sgd_and_option_ii_gives_the_gradient():
    lr = 0.1
    plain = _one_plain_step(lr)
    model, images, labels = _model_and_batch()
    x = {n: p.detach().clone() for n, p in trainable(model).items()}
    g = {n: (x[n] - p.detach()) / lr for n, p in trainable(plain).items()}  # the gradient at x
    c = {n: torch.full_like(t, 0.3) for n, t in x.items()}
    ci = {n: torch.full_like(t, -0.2) for n, t in x.items()}
    metrics, new_ci, delta = scaffold_train(model, images, labels, c_global=c, c_local=ci, lr=lr, **PLAIN_SGD)
    assert metrics["local-steps"] == 1
    for n, p in trainable(model).items():
        # y = x − η (g − c_i + c)
        assert torch.allclose(p.detach(), trainable(plain)[n].detach() - lr * (c[n] - ci[n]), atol=1e-6)
        # option II: c_i⁺ = c_i − c + (x − y)/(K η) = g after one step
        assert torch.allclose(new_ci[n], g[n], atol=1e-4)
        assert torch.allclose(delta[n], new_ci[n] - ci[n])
    # variates exist for trainable parameters only, never for BatchNorm buffers
    assert set(new_ci) == set(trainable(model)) and not any("running" in n for n in new_ci)
    # BatchNorm statistics evolve exactly as in plain SGD (the correction does not touch them)
    for name, buf in model.named_buffers():
        assert torch.equal(buf, dict(plain.named_buffers())[name])


def test_scaffold_with_zero_variates_is_plain_training():
    model, images, labels = _model_and_batch()
    scaffold_train(model, images, labels, c_global={}, c_local={}, lr=0.1, **{**PLAIN_SGD, "epochs": 2})
    plain, *_ = _model_and_batch()
    train_supervised(plain, images, labels, lr=0.1, **{**PLAIN_SGD, "epochs": 2})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


def test_scaffold_server_control_update():
    c = {"w": torch.tensor([1.0, 2.0])}
    deltas = [{"w": torch.tensor([0.5, 0.5])}, {"w": torch.tensor([1.5, -0.5])}]
    out = scaffold_server_control(c, deltas, num_clients=4)  # 2 of 4 clients replied
    assert torch.allclose(out["w"], torch.tensor([1.0 + 2.0 / 4, 2.0 + 0.0]))
    assert torch.equal(scaffold_server_control({}, deltas, 2)["w"], torch.tensor([1.0, 0.0]))


def test_feddyn_one_step_and_state_update():
    lr, alpha = 0.1, 0.5
    plain = _one_plain_step(lr)
    model, images, labels = _model_and_batch()
    x = {n: p.detach().clone() for n, p in trainable(model).items()}
    h = {n: torch.full_like(t, 0.2) for n, t in x.items()}
    _, new_h = feddyn_train(model, images, labels, h_local=h, alpha=alpha, lr=lr, **PLAIN_SGD)
    for n, p in trainable(model).items():
        # ∇[−⟨h, θ⟩ + α/2‖θ − x‖²] at θ = x is −h, so y = x − η(g − h)
        assert torch.allclose(p.detach(), trainable(plain)[n].detach() + lr * h[n], atol=1e-6)
        assert torch.allclose(new_h[n], h[n] - alpha * (p.detach() - x[n]))
    assert set(new_h) == set(trainable(model))


def test_feddyn_server_step_formula():
    prev = {"w": torch.tensor([1.0, 1.0])}
    models = [{"w": torch.tensor([2.0, 0.0])}, {"w": torch.tensor([4.0, 1.0])}]
    theta, h = feddyn_server_step(
        prev, models, {"w": torch.tensor([0.1, 0.1])}, alpha=0.5, num_clients=2, names=["w"]
    )
    # h = h − α/m Σ(θ_k − θ_prev) = 0.1 − 0.25·[4, −1];  θ = mean θ_k − h/α
    assert torch.allclose(h["w"], torch.tensor([0.1 - 1.0, 0.1 + 0.25]))
    assert torch.allclose(theta["w"], torch.tensor([3.0, 0.5]) - h["w"] / 0.5)


def _run(tmp_path, method, rounds=2, **extra):
    import strategies.feddyn
    import strategies.scaffold

    rc = {
        "method": method,
        "model": "tiny-cnn",
        "image-size": 32,
        "synthetic-per-class": 20,
        "num-server-rounds": rounds,
        "local-epochs": 1,
        "batch-size": 16,
        "optimizer": "sgd",
        "lr": 0.05,
        "partition": "dirichlet",
        "cache-dir": str(tmp_path / "cache"),
        **extra,
    }
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, {11: 0, 7: 1, 30: 2})
    recorder = RunRecorder(tmp_path / method, method, cfg.to_flat())
    strategy = {"scaffold": strategies.scaffold, "feddyn": strategies.feddyn}[method].build_strategy(
        cfg, recorder
    )
    model = create_model("tiny-cnn", 5, 32)
    result = run_federated(strategy, grid, ArrayRecord(model.state_dict()))
    return grid, strategy, result, recorder


def test_scaffold_end_to_end_keeps_client_variates_and_server_c_is_their_mean(tmp_path):
    grid, strategy, result, recorder = _run(tmp_path, "scaffold")
    states = [
        client_state(ctx).tensors("scaffold-c") for ctx in grid.contexts.values()
    ]  # the client-state store
    assert not any("running" in k for k in states[0])  # variates: trainable parameters only
    c = strategy.control.to_torch_state_dict()
    assert set(c) == set(states[0])
    for name in c:  # c starts at 0 and every client takes part: c = mean_i c_i
        assert torch.allclose(c[name], sum(s[name] for s in states) / 3, atol=1e-6)
    # round 2 sent the round-1 control, and the bytes of c were counted
    round2 = [m for m in grid.train_messages()][3:]
    assert all(len(m.content["control"]) == len(c) for m in round2)
    log = recorder.summary()["bytes_per_round"]
    arrays_bytes = ArrayRecord(create_model("tiny-cnn", 5, 32).state_dict()).count_bytes()
    assert log[0]["down"] == 3 * arrays_bytes and log[1]["down"] == 3 * (
        arrays_bytes + strategy.control.count_bytes()
    )


def test_feddyn_end_to_end_server_h_and_bn_buffers(tmp_path):
    grid, strategy, result, _ = _run(tmp_path, "feddyn", **{"feddyn.alpha": 0.1})
    states = [
        client_state(ctx).tensors("feddyn-h") for ctx in grid.contexts.values()
    ]  # the client-state store
    for name, h in strategy.h.items():  # h = mean_k h_k when every client takes part
        assert torch.allclose(h, sum(s[name] for s in states) / 3, atol=1e-6)
    last = [r for r in grid.replies if r.metadata.message_type == "train"][-3:]
    models = [r.content["arrays"].to_torch_state_dict() for r in last]
    weights = np.array([r.content["metrics"]["num-examples"] for r in last], dtype=float)
    final = result.to_torch_state_dict()  # run_federated returns the final global model
    name = "backbone.0.1.running_mean"  # buffers: the plain weighted average, no correction
    expected = sum(w * m[name] for w, m in zip(weights / weights.sum(), models))
    assert torch.allclose(final[name], expected.float(), atol=1e-5)
    w = "backbone.0.0.weight"  # parameters: uniform mean − h/α
    assert torch.allclose(final[w], sum(m[w] for m in models) / 3 - strategy.h[w] / 0.1, atol=1e-5)


def test_rounds_to_target_first_round_reaching_each_target():
    rounds = [
        {"round": r, "split": "val", "metrics": {"balanced_accuracy": v}}
        for r, v in enumerate([0.2, 0.5, 0.45, 0.7, float("nan"), 0.9])
    ]
    rounds.append({"round": 6, "split": "test", "metrics": {"balanced_accuracy": 1.0}})
    assert rounds_to_target(rounds, [0.5, 0.6, 0.9, 0.95]) == {"0.5": 1, "0.6": 3, "0.9": 5, "0.95": None}


def test_targets_key_and_exponential_lr():
    cfg = registry.load_config({"targets": "0.25, 0.35,0.45"})
    assert cfg.target_list == [0.25, 0.35, 0.45]
    with pytest.raises(ConfigError, match="'targets'"):
        registry.load_config({"targets": "0.5,abc"})
    with pytest.raises(ConfigError, match="'targets'"):
        registry.load_config({"targets": "55,65"})
    assert round_lr(0.1, 1, 50, "exponential", 0.998) == pytest.approx(0.1)
    assert round_lr(0.1, 11, 50, "exponential", 0.998) == pytest.approx(0.1 * 0.998**10)


def test_scaffold_server_model_is_the_uniform_mean_of_the_clients(tmp_path):
    """SCAFFOLD Alg. 1: x ← x + (1/|S|) Σ Δy_i, not FedAvg's example-weighted mean."""
    from flwr.app import Array, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.scaffold import DELTA, ScaffoldStrategy
    from tests.test_fedmae import FakeGrid as Nodes

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 4242, SUPERLINK_NODE_ID
    try:
        cfg = registry.load_config({"method": "scaffold", "model": "tiny-cnn"})
        strategy = ScaffoldStrategy(
            cfg=cfg,
            recorder=RunRecorder(tmp_path / "r", "scaffold", cfg.to_flat()),
            min_train_nodes=2,
            min_available_nodes=2,
            min_evaluate_nodes=2,
        )
        start = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
        ins = list(strategy.configure_train(1, start, ConfigRecord(), Nodes([11, 12])))
        ws, ns = [np.array([1, 2, 3], np.float32), np.array([5, 6, 7], np.float32)], [90, 10]
        replies = [
            Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({"w": Array(w)}),
                        DELTA: ArrayRecord({"w": Array(np.ones(3, np.float32))}),
                        "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0, "partition-id": i}),
                    }
                ),
                reply_to=m,
            )
            for i, (m, w, n) in enumerate(zip(ins, ws, ns))
        ]
        new, _ = strategy.aggregate_train(1, replies)
        assert np.allclose(
            new["w"].numpy(), [3, 4, 5]
        )  # (w1 + w2) / 2; weighted by 90/10 it would be [1.4, 2.4, 3.4]
        assert np.allclose(strategy.control["w"].numpy(), 1.0)  # c ← c + (1/N) Σ Δc_i
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def _signed_zeros(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a third of its entries +0 and a third −0, at places that differ from tensor to tensor."""
    t = t.clone()
    pick = torch.rand(t.shape, generator=torch.Generator().manual_seed(int(t.abs().sum() * 1e4) % 2**31))
    t[pick < 1 / 3] = 0.0
    t[pick > 2 / 3] = -0.0
    return t


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a
    )


def test_server_updates_are_the_formulas_bit_for_bit():
    """The in-place server updates give the very bits of the formulas
    written out, signed zeros included, and leave their inputs alone."""
    g = torch.Generator().manual_seed(1)
    rand = lambda: {n: _signed_zeros(torch.randn(40, generator=g)) for n in ("a", "b")}  # noqa: E731
    prev, h, c = rand(), rand(), rand()
    models = [rand() for _ in range(3)]
    for m in models:
        m["b"] = prev["b"].clone()  # no change: zero deltas
    kept = [{k: v.clone() for k, v in d.items()} for d in (prev, h, c, *models)]
    for k in (1, 2, 3):
        for hk in ({}, h):
            theta, new_h = feddyn_server_step(prev, models[:k], hk, 0.3, 4, ["a", "b"])
            want_h = {
                n: hk.get(n, torch.zeros_like(prev[n])) - 0.3 * sum(m[n] - prev[n] for m in models[:k]) / 4
                for n in prev
            }
            want_theta = {n: sum(m[n] for m in models[:k]) / k - want_h[n] / 0.3 for n in prev}
            assert _same_bits(new_h, want_h) and _same_bits(theta, want_theta)
        for base in ({}, c):
            out = scaffold_server_control(base, models[:k], 4)
            want = {n: base.get(n, torch.zeros(40)) + sum(m[n] for m in models[:k]) / 4 for n in prev}
            assert _same_bits(out, want)
    assert all(_same_bits(a, b) for a, b in zip(kept, (prev, h, c, *models)))


def test_client_updates_are_the_formulas_bit_for_bit():
    """SCAFFOLD's c_i⁺, Δc and FedDyn's h_k computed in place: the bits of the formulas."""
    lr, alpha = 0.1, 0.5
    model, images, labels = _model_and_batch()
    x = {n: p.detach().clone() for n, p in trainable(model).items()}
    c_local = {n: _signed_zeros(torch.randn_like(t)) for n, t in x.items()}
    c_global = {n: _signed_zeros(torch.randn_like(t)) for n, t in x.items()}
    kept = ({n: t.clone() for n, t in c_local.items()}, {n: t.clone() for n, t in c_global.items()})
    metrics, new_local, delta = scaffold_train(
        model, images, labels, c_global=c_global, c_local=c_local, lr=lr, **PLAIN_SGD
    )
    k = metrics["local-steps"]
    y = {n: p.detach() for n, p in trainable(model).items()}
    want = {n: c_local[n] - c_global[n] + (x[n] - y[n]) / (k * lr) for n in x}
    assert _same_bits(new_local, want)
    assert _same_bits(delta, {n: want[n] - c_local[n] for n in x})
    assert _same_bits(c_local, kept[0]) and _same_bits(c_global, kept[1])

    model, images, labels = _model_and_batch()
    h = {n: _signed_zeros(torch.randn_like(t)) for n, t in x.items()}
    _, new_h = feddyn_train(model, images, labels, h_local=h, alpha=alpha, lr=lr, **PLAIN_SGD)
    y = {n: p.detach() for n, p in trainable(model).items()}
    assert _same_bits(new_h, {n: h[n] - alpha * (y[n] - x[n]) for n in x})
    assert not any(t.data_ptr() == p.data_ptr() for t, p in zip(new_h.values(), trainable(model).values()))


def test_feddyn_server_does_not_average_the_parameters_it_replaces(tmp_path, monkeypatch):
    """FedDyn's θ^t replaces the FedAvg mean of the parameters: the mean covers the buffers only
    (one model-sized mean and encode less per round on the server)."""
    import wire

    seen = []
    mean = wire.weighted_mean

    def spy(records, weights):
        seen.append(set(records[0].keys()))
        return mean(records, weights)

    monkeypatch.setattr(wire, "weighted_mean", spy)
    _, strategy, result, _ = _run(tmp_path, "feddyn", **{"feddyn.alpha": 0.1})
    assert len(seen) == 2 and all(keys and not keys & set(strategy.param_names) for keys in seen)
    assert list(result.keys()) == list(create_model("tiny-cnn", 5, 32).state_dict())
