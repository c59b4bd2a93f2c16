"""Model-update privacy of the FedAvg family (strategies/dp.py): server-side fixed clipping
and Gaussian noise with Flower's DP functions; ε with Opacus' RDP accountant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

import registry
from fedderm.config import ConfigError
from fedderm.models import create_model
from fedderm.results import RunRecorder
from strategies import fedavg, fedprox
from tests.fake_grid import FakeGrid

NODES = (7001, 7002, 7003)
NORMS = (0.5, 3.0, 10.0)  # the clients' update norms; C = 1 clips the last two


def _strategy(
    tmp_path,
    sigma: float,
    seed: int = 0,
    method: str = "fedavg",
    clip: float = 1.0,
    reproducible: bool = False,
):
    rc = {
        "insecure-reproducible-noise": reproducible,
        "method": method,
        "model": "tiny-cnn",
        "image-size": 16,
        "seed": seed,
        "min-clients": 3,
        "dp.mode": "server",
        "dp.clip-norm": clip,
        "dp.noise-multiplier": sigma,
        "tensorboard": False,
    }
    cfg = registry.load_config(rc)
    FakeGrid(rc, 3)  # sets the task identity messages need
    rec = RunRecorder(tmp_path / f"{method}-{sigma}-{seed}-{reproducible}", method, cfg.to_flat())
    return (fedavg if method == "fedavg" else fedprox).build_strategy(cfg, rec)


def _round(strategy, server_round: int = 1):
    """One aggregation of 3 replies whose updates have norms NORMS (float params; int buffers kept)."""
    torch.manual_seed(0)
    state = create_model("tiny-cnn", 3, 16).state_dict()
    sent = ArrayRecord({k: Array(v.numpy()) for k, v in state.items()})
    strategy.sent, strategy._sent_to = sent, list(NODES)
    rng = np.random.default_rng(1)
    floats = [k for k, v in state.items() if v.is_floating_point()]
    directions = []
    replies = []
    for i, (node, norm) in enumerate(zip(NODES, NORMS, strict=True)):
        d = {k: rng.standard_normal(state[k].shape).astype(np.float32) for k in floats}
        scale = norm / np.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in d.values()))
        d = {k: (x * scale).astype(np.float32) for k, x in d.items()}
        directions.append(d)
        arrays = {k: Array(state[k].numpy() + d[k]) if k in d else Array(state[k].numpy()) for k in state}
        out = Message(
            RecordDict({"arrays": sent, "config": ConfigRecord()}), dst_node_id=node, message_type="train"
        )
        metrics = MetricRecord({"num-examples": 10 * (i + 1), "partition-id": i})
        content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics})
        replies.append(Message(content, reply_to=out))
    before = np.random.get_state()[1].copy()
    new, _ = strategy.aggregate_train(server_round, replies)
    assert np.array_equal(np.random.get_state()[1], before)  # NumPy's global generator is untouched
    strategy.record_notes()  # the round loop's record step
    return state, floats, directions, replies, new


def test_every_update_is_clipped_to_c_and_the_mean_is_unweighted(tmp_path):
    strategy = _strategy(tmp_path, sigma=0.0)
    state, floats, directions, replies, new = _round(strategy)
    for msg, norm in zip(replies, NORMS, strict=True):  # the clipped replies FedAvg averaged
        rec = msg.content["arrays"]
        got = np.sqrt(sum(float(((rec[k].numpy() - state[k].numpy()) ** 2).sum()) for k in state))
        assert got == pytest.approx(min(norm, 1.0), rel=1e-6)
    # equal weights despite num-examples 10/20/30: w + (1/3) Σ Δ_i · min(1, C/‖Δ_i‖)
    for k in floats:
        want = state[k].numpy() + sum(d[k] * min(1.0, 1.0 / n) for d, n in zip(directions, NORMS)) / 3
        np.testing.assert_allclose(new[k].numpy(), want, atol=1e-6)
    for k in state:
        assert new[k].numpy().dtype == state[k].numpy().dtype
    (entry,) = strategy.recorder.extra["model_privacy"]
    assert entry["clipped"] == 2 and entry["clients"] == 3 and entry["epsilon"] == float("inf")
    assert entry["update_norm_max"] == pytest.approx(10.0, rel=1e-6)


def test_noise_has_std_sigma_c_over_m_and_only_the_insecure_switch_fixes_it_by_the_seed(tmp_path):
    """σC/m; the same seed draws new noise (the OS's CSPRNG), unless insecure-reproducible-noise."""
    _, floats, _, _, clean = _round(_strategy(tmp_path, sigma=0.0))
    _, _, _, _, a = _round(_strategy(tmp_path, sigma=2.0, seed=0))
    _, _, _, _, b = _round(_strategy(tmp_path, sigma=2.0, seed=0))
    for got in (a, b):
        noise = np.concatenate([(got[k].numpy() - clean[k].numpy()).ravel() for k in floats])
        assert noise.size > 1000
        assert noise.std() == pytest.approx(2.0 * 1.0 / 3, rel=0.1)  # compute_stdv: σC/m
    assert all(not np.array_equal(a[k].numpy(), b[k].numpy()) for k in floats)
    _, _, _, _, c = _round(_strategy(tmp_path, sigma=2.0, seed=0, reproducible=True))
    _, _, _, _, d = _round(_strategy(tmp_path, sigma=2.0, seed=0, reproducible=True))
    _, _, _, _, e = _round(_strategy(tmp_path, sigma=2.0, seed=1, reproducible=True))
    for k in floats:
        np.testing.assert_array_equal(c[k].numpy(), d[k].numpy())
    assert any(not np.array_equal(c[k].numpy(), e[k].numpy()) for k in floats)


def test_epsilon_composes_over_rounds_and_equals_opacus(tmp_path):
    from opacus.accountants import RDPAccountant

    strategy = _strategy(tmp_path, sigma=1.5, method="fedprox")
    _round(strategy, 1)
    _round(strategy, 2)
    eps = [e["epsilon"] for e in strategy.recorder.extra["model_privacy"]]
    for rounds, got in enumerate(eps, start=1):
        acc = RDPAccountant()
        acc.history = [(1.5, 1.0, rounds)]
        assert got == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
    assert 0 < eps[0] < eps[1] < float("inf")
    assert strategy.state_dict()["dp_releases"] == 2
    sigmas = [_strategy(tmp_path, sigma=s) for s in (0.5, 1.0, 4.0)]
    for s in sigmas:
        _round(s)
    e = [s.recorder.extra["model_privacy"][0]["epsilon"] for s in sigmas]
    assert e[0] > e[1] > e[2] > 0


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"method": "scaffold", "dp.mode": "server"}, "dp.mode"),
        ({"method": "fedclf", "dp.mode": "server"}, "dp.mode"),
        ({"method": "fedavg", "dp.mode": "client"}, "dp.mode"),
        ({"method": "fedavg", "dp.mode": "central"}, "dp.mode"),
        ({"method": "fedavg", "dp.clip-norm": 0.0}, "dp.clip-norm"),
        ({"method": "fedavg", "dp.noise-multiplier": -1.0}, "dp.noise-multiplier"),
        ({"method": "fedprox", "dp.delta": 1.0}, "dp.delta"),
    ],
)
def test_bad_dp_settings_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        registry.load_config(raw)


def test_dp_off_keeps_flowers_weighted_fedavg(tmp_path):
    cfg = registry.load_config({"method": "fedavg"})
    strategy = fedavg.build_strategy(cfg, RunRecorder(tmp_path / "off", "fedavg", cfg.to_flat()))
    assert type(strategy) is fedavg.FedAvgStrategy and not strategy.uniform_mean


@pytest.mark.parametrize("reproducible", [False, True])
def test_private_fedavg_runs_through_the_round_loop(tmp_path, reproducible):
    """Two 1-round FedAvg runs on the bundled digits (2 clients, in-process) with dp.mode = server and
    σ = 1: ε recorded for the round; the same seed gives other noise, so another final model,
    unless insecure-reproducible-noise, which repeats it bit for bit."""
    from strategies.common import run_federated

    finals = []
    for run in range(2):
        rc = {
            "insecure-reproducible-noise": reproducible,
            "method": "fedavg",
            "dataset": "digits",
            "partition": "iid",
            "model": "tiny-cnn",
            "image-size": 16,
            "num-server-rounds": 1,
            "local-epochs": 1,
            "batch-size": 64,
            "dp.mode": "server",
            "dp.clip-norm": 0.5,
            "dp.noise-multiplier": 1.0,
            "tensorboard": False,
            "cache-dir": str(tmp_path / "cache"),
        }
        cfg = registry.load_config(rc)
        rec = RunRecorder(tmp_path / f"run{run}", "fedavg", cfg.to_flat())
        strategy = fedavg.build_strategy(cfg, rec)
        torch.manual_seed(0)
        model = create_model("tiny-cnn", 10, 16)
        finals.append(run_federated(strategy, FakeGrid(rc, 2), ArrayRecord(model.state_dict())))
        (entry,) = rec.extra["model_privacy"]
        assert entry["round"] == 1 and entry["clients"] == 2 and entry["noise_std"] == pytest.approx(0.25)
        assert 0 < entry["epsilon"] < float("inf")
    same = {k: np.array_equal(finals[0][k].numpy(), finals[1][k].numpy()) for k in finals[0].keys()}
    floats = [k for k in same if finals[0][k].numpy().dtype.kind == "f"]  # noise below 1 rounds ints to 0
    assert all(same.values()) if reproducible else not any(same[k] for k in floats)


@pytest.mark.parametrize("sigma", [0.0, 2.0])
def test_clipping_and_noise_equal_flowers_public_dp_wrapper_bit_for_bit(tmp_path, sigma):
    """strategies/dp.py writes out the computation of Flower's DifferentialPrivacyServerSideFixedClipping
    (whose helpers are private): on a float64 model (the wrapper clips in the replies' dtype,
    fedderm in float64) with equal weights, and with insecure-reproducible-noise the same NumPy
    seed, both give the same bits."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    from strategies.dp import noise_seed

    strategy = _strategy(tmp_path, sigma=sigma, seed=3, clip=1.0, reproducible=True)
    rng = np.random.default_rng(5)
    sent = ArrayRecord(
        {k: Array(rng.standard_normal(s)) for k, s in (("a", (4, 3)), ("b", (7,)), ("c", (1,)))}
    )
    strategy.sent, strategy._sent_to = sent, list(NODES)

    def replies():
        out = []
        for i, (node, scale) in enumerate(zip(NODES, (0.1, 2.0, 9.0), strict=True)):
            arrays = {
                k: Array(a.numpy() + scale * np.random.default_rng(i).standard_normal(a.numpy().shape))
                for k, a in sent.items()
            }
            instr = Message(
                RecordDict({"arrays": sent, "config": ConfigRecord()}), dst_node_id=node, message_type="train"
            )
            metrics = MetricRecord({"num-examples": 10, "partition-id": i})
            out.append(
                Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=instr)
            )
        return out

    ours, _ = strategy.aggregate_train(1, replies())
    flower = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(min_available_nodes=1), noise_multiplier=sigma, clipping_norm=1.0, num_sampled_clients=3
    )
    flower.current_arrays = sent  # what its configure_train keeps
    np.random.seed(noise_seed(3, 1))
    theirs, _ = flower.aggregate_train(1, replies())
    assert list(ours.keys()) == list(theirs.keys())
    for k in sent.keys():
        assert ours[k].numpy().dtype == np.float64
        assert np.array_equal(ours[k].numpy(), theirs[k].numpy()), k
    assert sigma == 0 or not np.array_equal(ours["a"].numpy(), sent["a"].numpy())
