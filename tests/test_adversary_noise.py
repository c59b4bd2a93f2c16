"""Attacks on fedderm's privacy randomness, and what a deployment refuses (docs/privacy.md).

Every party knows the run config, ``seed`` included, and can read the code.  Noise or a shuffle
that the run config determines can be regenerated and undone:

- a curious server subtracts FedCLF's relay noise and re-identifies every relayed feature;
- a client subtracts the server's DP noise (``dp.mode = "server"``) and recovers the other client's
  update;
- a client reverses the relay's shuffle and attributes every relayed row to its source.

Each attack below reproduces the randomness the way the run config would determine it (the
generators fedderm used before its noise came from the OS's CSPRNG, which
``insecure-reproducible-noise`` still uses) and must get nothing more than chance.  Then: a run
without privacy noise still repeats bit for bit; the insecure switch is off by default, recorded
in summary.json when on, and refused by a deployment; and a deployment of FedCLF relays raw
features only when the run config says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

import registry
import sim
from clients.common import session
from clients.fedclf import BANK
from clients.state import client_state
from fedderm.config import ConfigError
from fedderm.methods import SMALL_VIT
from fedderm.models import create_model
from fedderm.noise import INSECURE, REPRODUCIBLE, insecure_entry
from fedderm.results import RunRecorder
from strategies import fedavg, fedclf, fedprox
from strategies.dp import deployed, noise_seed
from strategies.finetune import pretrain
from wire import FEATURES, REMOTE

ROOT = Path(__file__).resolve().parents[1]


class DeploymentGrid(FakeGrid):
    """A FakeGrid the app takes for a SuperLink's (fedderm.flower_private.grid_kind)."""

    fedderm_grid_kind = "deployment"


def recorder(tmp_path: Path, cfg, name: str = "run") -> RunRecorder:
    return RunRecorder(tmp_path / name, cfg.method, cfg.to_flat())


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every row of ``a`` against every row of ``b``."""
    return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T


# ----------------------------------------------------------------------- the curious server
RELAY = {
    "method": "fedclf",
    "dataset": "digits",
    "partition": "iid",
    "model": "tiny-cnn",
    "image-size": 16,
    "batch-size": 64,
    "fedclf.queue-size": 256,
    "fedclf.relay-clip": 1.0,
    "fedclf.relay-noise-multiplier": 8.0,
    "tensorboard": False,
}


def test_curious_server_cannot_subtract_the_relay_noise(tmp_path):
    """The server receives a client's initial upload (256 clipped features + N(0, (σC)²), σ = 8)
    and subtracts the noise that seed, round and partition id determine (``ClientSession.seed``,
    the client's seeds): the recovered rows are as far from the true features as chance (mean cosine
    < 0.1; the attack before: 0.9998) and re-identify no more rows than chance (≤ 8 of 256, 1
    expected; before: 256)."""
    rc = {**RELAY, "cache-dir": str(tmp_path / "cache")}
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    node, ctx = next(iter(grid.contexts.items()))
    query = Message(
        RecordDict({"arrays": fedclf.initial_moco(cfg), "config": ConfigRecord({"server-round": 0})}),
        dst_node_id=node,
        message_type="query.features",
    )
    (reply,) = grid.send_and_receive([query])
    received = torch.from_numpy(reply.content[FEATURES]["features"].numpy().astype(np.float32))
    true = client_state(ctx).tensors(BANK)["features"]  # unit vectors: clipping to C = 1 keeps them
    assert received.shape == true.shape == (256, 128)
    regenerated = torch.randn(
        true.shape, generator=torch.Generator().manual_seed(session(ctx).seed(0, salt=13))
    )
    recovered = received - regenerated * 8.0
    scores = cosine(recovered, true)
    reidentified = int((scores.argmax(dim=1) == torch.arange(len(true))).sum())
    assert scores.diagonal().mean().item() < 0.1
    assert reidentified <= 8


# ----------------------------------------------------------------------- a client against DP
@pytest.mark.parametrize("module, mode", [(fedavg, "server"), (fedprox, "server")])
def test_client_cannot_regenerate_the_servers_dp_noise(tmp_path, module, mode):
    """Two clients, ``dp.mode`` with σ = 1, C = 1.  Client 0 knows the global model it was sent, its
    own update, the run config, the round and m = 2; it regenerates the round's noise as the seed
    determines it (``noise_seed``, NumPy's legacy generator) and solves the new global model for
    the other client's clipped update.  The error is of the noise's size (the attack before:
    2e-7)."""
    method = module.__name__.split(".")[-1]
    rc = {"method": method, "model": "vit-micro", "image-size": 16, "seed": 5, "min-clients": 2}
    rc.update({"dp.mode": mode, "dp.clip-norm": 1.0, "dp.noise-multiplier": 1.0, "tensorboard": False})
    cfg = registry.load_config(rc)
    FakeGrid(rc, 2)  # the task identity messages need
    strategy = module.build_strategy(cfg, recorder(tmp_path, cfg))
    torch.manual_seed(0)
    state = {k: v.numpy() for k, v in create_model("vit-micro", 3, 16).state_dict().items()}
    names = list(state)
    sent = ArrayRecord({k: Array(v) for k, v in state.items()})
    strategy.sent, strategy._sent_to = sent, [7001, 7002]
    rng = np.random.default_rng(1)
    deltas, replies = [], []
    for i, (node, norm) in enumerate(((7001, 0.5), (7002, 3.0))):
        d = {
            k: rng.standard_normal(v.shape) if v.dtype.kind == "f" else np.zeros_like(v)
            for k, v in state.items()
        }
        scale = norm / np.sqrt(sum(float((x**2).sum()) for x in d.values()))
        d = {k: (x * scale).astype(state[k].dtype) for k, x in d.items()}
        deltas.append({k: d[k].astype(np.float64) * min(1.0, 1.0 / norm) for k in names})  # clipped
        out = Message(
            RecordDict({"arrays": sent, "config": ConfigRecord()}), dst_node_id=node, message_type="train"
        )
        arrays = ArrayRecord({k: Array(np.asarray(state[k] + d[k])) for k in names})
        metrics = MetricRecord({"num-examples": 10, "partition-id": i})
        replies.append(Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=out))
    new, _ = strategy.aggregate_train(1, replies)
    std = 1.0 * 1.0 / 2
    attacker = np.random.RandomState(noise_seed(cfg.seed, 1))
    err, norm = 0.0, 0.0
    for k in names:
        noise = attacker.normal(0, std, state[k].shape)
        other = 2 * (new[k].numpy() - noise - state[k].astype(np.float64)) - deltas[0][k]
        if state[k].dtype.kind == "f":
            err += float(((other - deltas[1][k]) ** 2).sum())
            norm += float((deltas[1][k] ** 2).sum())
    assert np.sqrt(norm) == pytest.approx(1.0, rel=1e-5)  # the other's update, clipped to C
    assert np.sqrt(err) > 10 * np.sqrt(norm)  # noise, not the update


# ----------------------------------------------------------------------- a client against the shuffle
def test_client_cannot_reverse_the_relay_shuffle(tmp_path):
    """Three clients upload 64 features each; every client receives the other two's 128 rows.  It
    replays the shuffle as (seed, round) determines it — the generator the server draws one
    permutation from per destination, in the server's order — and attributes each row it received
    to a source: right for about half the rows (chance with two equal sources; before: all)."""
    rc = {"method": "fedclf", "model": "tiny-cnn", "image-size": 16, "seed": 3, "min-clients": 3}
    rc.update({"fedclf.queue-size": 64, "tensorboard": False, "cache-dir": str(tmp_path / "c")})
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 3)
    nodes = grid.get_node_ids()
    strategy = fedclf.build_strategy(cfg, recorder(tmp_path, cfg))
    rng = np.random.default_rng(0)
    uploads = {nid: rng.standard_normal((64, 128)).astype(np.float16) for nid in nodes}
    replies = []
    for pid, nid in enumerate(nodes):
        out = Message(
            RecordDict({"config": ConfigRecord({"server-round": 1})}),
            dst_node_id=nid,
            message_type="train.pretrain",
        )
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(np.zeros(2, np.float32))}),
                "metrics": MetricRecord({"num-examples": 10, "partition-id": pid, "train_loss": 1.0}),
                FEATURES: ArrayRecord({"features": Array(uploads[nid])}),
            }
        )
        replies.append(Message(content, reply_to=out))
    arrays, _ = strategy.aggregate_train(1, replies)
    messages = strategy.configure_train(2, arrays, ConfigRecord(), grid)
    replay = np.random.default_rng([cfg.seed, 2])
    for msg in messages:  # in the order the server shuffled them
        nid = msg.metadata.dst_node_id
        got = msg.content[REMOTE]["features"].numpy()
        sources = [n for n in nodes if n != nid]  # the upload order: partition ids
        source_of_row = np.repeat(sources, 64)[replay.permutation(len(got))]
        truth = [next(n for n in sources if (uploads[n] == row).all(axis=1).any()) for row in got]
        assert np.mean(source_of_row == np.array(truth)) < 0.7


# ----------------------------------------------------------------------- same seed, same numbers
TINY_FEDCLF = {
    "method": "fedclf",
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "num-server-rounds": 2,
    "local-epochs": 1,
    "batch-size": 8,
    "optimizer": "sgd",
    "lr": 0.03,
    "fedclf.queue-size": 24,
    "tensorboard": False,
}


def _pretrain(tmp_path: Path, name: str, **overrides) -> tuple[dict, list[np.ndarray]]:
    """TINY_FEDCLF's pre-training on 3 clients: (the final weights, the remote features sent)."""
    rc = {**TINY_FEDCLF, "cache-dir": str(tmp_path / "cache"), **overrides}
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 3)
    arrays = pretrain(
        fedclf.build_strategy(cfg, recorder(tmp_path, cfg, name)), grid, fedclf.initial_moco(cfg)
    )
    relayed = [m.content[REMOTE]["features"].numpy() for m in grid.sent if REMOTE in m.content]
    return arrays.to_torch_state_dict(), relayed


def test_fedclf_without_noise_repeats_bit_for_bit_though_its_shuffle_does_not(tmp_path):
    """The relay's shuffle is secure (two runs relay their rows in other orders) and changes no
    number: the clients sort what they receive, so the same seed gives the same weights."""
    (a, relayed_a), (b, relayed_b) = _pretrain(tmp_path, "a"), _pretrain(tmp_path, "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(relayed_a) == len(relayed_b) == 6
    for x, y in zip(relayed_a, relayed_b, strict=True):
        assert sorted(map(bytes, x)) == sorted(map(bytes, y))  # the same rows ...
    assert not all(np.array_equal(x, y) for x, y in zip(relayed_a, relayed_b))  # ... in other orders


def test_relay_noise_differs_between_runs_of_one_seed_unless_insecure(tmp_path):
    """Two runs with relay noise and one seed upload different features (the seed does not determine
    the noise); with insecure-reproducible-noise they repeat bit for bit."""
    noisy = {"fedclf.relay-clip": 1.0, "fedclf.relay-noise-multiplier": 1.0, "num-server-rounds": 1}
    (a, relayed_a), (b, relayed_b) = _pretrain(tmp_path, "a", **noisy), _pretrain(tmp_path, "b", **noisy)
    assert sorted(map(bytes, relayed_a[0])) != sorted(map(bytes, relayed_b[0]))
    assert not torch.equal(a["backbone.0.0.weight"], b["backbone.0.0.weight"])
    insecure = {**noisy, REPRODUCIBLE: True}
    (c, relayed_c), (d, relayed_d) = (
        _pretrain(tmp_path, "c", **insecure),
        _pretrain(tmp_path, "d", **insecure),
    )
    assert all(np.array_equal(x, y) for x, y in zip(relayed_c, relayed_d, strict=True))
    assert all(torch.equal(c[k], d[k]) for k in c)


# ----------------------------------------------------------------------- the insecure switch
def test_insecure_switch_is_off_by_default_and_recorded_when_on(tmp_path):
    """Off in the declared defaults (and so in pyproject.toml); when on, summary.json's ``insecure``
    lists what it weakened in this run, and nothing is written while it is off."""
    assert registry.load_config({}).insecure_reproducible_noise is False
    dp = {"method": "fedavg", "model": "vit-micro", "dp.mode": "server", "dp.noise-multiplier": 1.0}
    relay = {"method": "fedclf", "fedclf.relay-clip": 1.0, "fedclf.relay-noise-multiplier": 1.0}
    cases = [
        (dp, ["dp.noise-multiplier"]),
        (relay, ["fedclf.relay-noise-multiplier", "fedclf.feature-sharing"]),
        ({"method": "fedclf"}, ["fedclf.feature-sharing"]),
        ({"method": "fedclf", "fedclf.feature-sharing": False}, []),
        ({"method": "fedavg"}, []),
    ]
    for i, (raw, keys) in enumerate(cases):
        off = registry.load_config(raw)
        assert INSECURE not in json.loads((recorder(tmp_path, off, f"off{i}").summary_path).read_text())
        on = registry.load_config({**raw, REPRODUCIBLE: True})
        entry = json.loads(recorder(tmp_path, on, f"on{i}").summary_path.read_text())[INSECURE]
        assert entry[REPRODUCIBLE] is True
        assert [line.split(":")[0] for line in entry["weakened"]] == (keys or ["nothing"])


def test_insecure_run_records_it_in_summary_json(in_process, tmp_path):
    """A whole run (sim.py's path, in-process) with the switch on: summary.json says so."""
    run_dir = sim.simulate(
        registry.smallest_run(
            "fedavg",
            **{
                **SMALL_VIT,  # dp.mode takes no BatchNorm model
                "dp.mode": "server",
                "dp.noise-multiplier": 1.0,
                REPRODUCIBLE: True,
                "output-dir": str(tmp_path),
                "cache-dir": str(tmp_path / "cache"),
                "run-name": "insecure",
            },
        ),
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary[INSECURE] == insecure_entry(summary["config"])
    assert summary[INSECURE]["weakened"][0].startswith("dp.noise-multiplier")


def test_deployment_refuses_the_insecure_switch(tmp_path):
    """FedCLF's relay and FedAvg's DP in a deployment with the switch on stop before any message,
    naming the key; in a simulation the same settings run."""
    rc = {**TINY_FEDCLF, "fedclf.feature-sharing": True, REPRODUCIBLE: True, "cache-dir": str(tmp_path / "c")}
    cfg = registry.load_config(rc)
    grid = DeploymentGrid(rc, 2)
    with pytest.raises(ConfigError, match=f"'{REPRODUCIBLE}'.*deployment"):
        fedclf.run(grid, cfg, recorder(tmp_path, cfg), ["a", "b", "c", "d", "e"])
    assert grid.sent == []
    rc = {
        "method": "fedavg",
        **SMALL_VIT,
        "dp.mode": "server",
        "dp.noise-multiplier": 1.0,
        REPRODUCIBLE: True,
        "min-clients": 2,
    }
    cfg = registry.load_config(rc)
    torch.manual_seed(0)
    arrays = ArrayRecord(create_model("vit-micro", 3, 16).state_dict())
    for kind, grid in (("deployment", DeploymentGrid(rc, 2)), ("simulation", FakeGrid(rc, 2))):
        strategy = fedavg.build_strategy(cfg, recorder(tmp_path, cfg, kind))
        if kind == "deployment":
            with pytest.raises(ConfigError, match=f"'{REPRODUCIBLE}'"):
                strategy.configure_train(1, arrays, ConfigRecord(), grid)
        else:
            assert len(list(strategy.configure_train(1, arrays, ConfigRecord(), grid))) == 2


def test_an_unknown_flower_grid_counts_as_a_deployment():
    """Fail closed: a Flower Grid that is neither the simulation's nor the SuperLink's (a later
    Flower's) is a deployment; the tests' grids say what they stand for."""
    from flwr.serverapp import Grid

    from strategies.fastpoll import FastPollGrid

    class LaterFlowerGrid(Grid):
        """A Flower grid fedderm does not know (its methods are never called here)."""

    LaterFlowerGrid.__abstractmethods__ = frozenset()

    assert deployed(LaterFlowerGrid()) and deployed(FastPollGrid(LaterFlowerGrid()))
    assert deployed(DeploymentGrid({}, 1)) and not deployed(FakeGrid({}, 1))


# ----------------------------------------------------------------------- FedCLF in a deployment
def test_fedclf_deployment_relays_raw_features_only_when_told(tmp_path):
    """``fedclf.feature-sharing = "auto"`` (the default): on in a simulation; in a deployment the
    run stops before any message, naming the key and what would leave, unless it is set to true or
    the private relay is on; false is FedMoCo everywhere."""
    base = {**TINY_FEDCLF, "cache-dir": str(tmp_path / "c")}
    cfg = registry.load_config(base)
    assert cfg.option("fedclf.feature-sharing") == "auto"
    grid = DeploymentGrid(base, 2)
    with pytest.raises(ConfigError, match=r"'fedclf.feature-sharing'.*raw MoCo features"):
        fedclf.run(grid, cfg, recorder(tmp_path, cfg, "refused"), ["a", "b", "c", "d", "e"])
    assert grid.sent == []
    private = {"fedclf.relay-clip": 1.0, "fedclf.relay-noise-multiplier": 1.0}
    for raw, deployment, sharing in [
        ({}, False, True),
        ({"fedclf.feature-sharing": True}, True, True),
        (private, True, True),
        ({"fedclf.feature-sharing": False}, True, False),
        ({"fedclf.feature-sharing": False}, False, False),
    ]:
        cfg = registry.load_config({**base, **raw})
        strategy = fedclf.build_strategy(cfg, recorder(tmp_path, cfg, f"s{len(raw)}"), deployment=deployment)
        assert strategy.feature_sharing is sharing
    with pytest.raises(ConfigError, match="fedclf.feature-sharing"):
        registry.load_config({**base, "fedclf.feature-sharing": "yes"})


# ----------------------------------------------------------------------- what leaves a hospital
def test_deploy_page_lists_what_each_method_sends():
    """docs/deploy.md "What leaves a hospital, per method": one row per registered method, whose
    records are exactly its registration's ``sends`` (what the audit test holds every reply to)."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text.split("## What leaves a hospital, per method", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`")] = set(re.findall(r"`([a-z0-9-]+)`", cells[1]))
    assert rows.keys() == registry.METHODS.keys()
    for name, method in registry.METHODS.items():
        assert rows[name] == set(method.sends), name


# ------------------------------------------------------------- a hospital and the insecure switch
def _hospital_grid(tmp_path: Path, rc: dict, node_configs: list[dict]) -> FakeGrid:
    """A FakeGrid whose nodes have a deployed hospital's node config (their own data folder, plus
    ``node_configs``); the server driving it does not take it for a deployment, as modified server
    code that skips its own refusal would not."""
    from deploy.loopback import make_hospital_data

    names = [f"h{i}" for i in range(len(node_configs))]
    folders = make_hospital_data(tmp_path / "data", names, per_class=6, image_size=16)
    grid = FakeGrid(rc, len(node_configs))
    for i, (context, extra) in enumerate(zip(grid.contexts.values(), node_configs, strict=True)):
        own = {"partition-id": i, "site": names[i], "dataset": "folder", "data-path": str(folders[names[i]])}
        context.node_config = {**own, **extra}
    return grid


def _relay_with_the_switch(
    tmp_path: Path, node_configs: list[dict], monkeypatch, rounds: bool = True
) -> tuple[FakeGrid, list]:
    """FedCLF with relay noise and insecure-reproducible-noise = true sent to the hospitals of
    :func:`_hospital_grid`: the initial features (``query.features``) and, with ``rounds``, one
    pre-training round.  Returns the grid and the noise seeds the clients drew with."""
    import clients.fedclf

    drawn = []
    real = clients.fedclf.privatise
    monkeypatch.setattr(clients.fedclf, "privatise", lambda *a, **k: drawn.append(a[3]) or real(*a, **k))
    rc = {
        **TINY_FEDCLF,
        "num-server-rounds": 1,
        "fedclf.relay-clip": 1.0,
        "fedclf.relay-noise-multiplier": 1.0,
        REPRODUCIBLE: True,
        "cache-dir": str(tmp_path / "cache"),
    }
    cfg = registry.load_config(rc)
    grid = _hospital_grid(tmp_path, rc, node_configs)
    strategy = fedclf.build_strategy(cfg, recorder(tmp_path, cfg))
    if not rounds:
        strategy.collect_initial_features(fedclf.initial_moco(cfg), grid.get_node_ids(), grid)
        return grid, drawn
    try:
        pretrain(strategy, grid, fedclf.initial_moco(cfg))
    except Exception:  # noqa: BLE001 - without any client's features the relay cannot start
        pass
    return grid, drawn


def test_a_hospital_refuses_the_insecure_switch_sent_by_the_server(tmp_path, monkeypatch):
    """The attack: a coordinating site that runs modified server code sends
    insecure-reproducible-noise = true to hospitals whose SuperNodes name their own data, to
    regenerate and subtract their relay noise.  Every hospital answers with an error naming the key
    and sends no feature; none draws noise.  A node config that also holds num-partitions (a
    simulation's key) is still a hospital's: its own data-path decides."""
    grid, drawn = _relay_with_the_switch(tmp_path, [{}, {"num-partitions": 2}], monkeypatch)
    kinds = {msg.metadata.message_type for msg in grid.sent}
    assert kinds == {"query.features", "train.pretrain"} and len(grid.replies) == len(grid.sent)
    assert drawn == []
    assert not any(reply.has_content() and FEATURES in reply.content for reply in grid.replies)
    assert not any(REMOTE in msg.content for msg in grid.sent)
    for reply in grid.replies:
        assert reply.has_error()
        assert f"'{REPRODUCIBLE}'" in reply.error.reason and "node config" in reply.error.reason


def test_a_hospital_that_opts_in_with_its_own_node_config_takes_the_switch(tmp_path, monkeypatch):
    """The hospital's own --node-config 'insecure-reproducible-noise=true' lets it take the switch
    (its seeded noise drawn, its features uploaded and relayed); a simulation's nodes take it with no
    opt-in (tests/test_leakage.py, bench/privacy.py, test_relay_noise_differs_..._unless_insecure)."""
    grid, drawn = _relay_with_the_switch(tmp_path, [{REPRODUCIBLE: True}] * 2, monkeypatch, rounds=False)
    assert len(grid.replies) == 2 and not any(reply.has_error() for reply in grid.replies)
    assert all(FEATURES in reply.content for reply in grid.replies)
    assert len(drawn) == 2 and all(seed is not None for seed in drawn)  # seeded: the switch taken


def test_the_node_config_opt_in_is_a_boolean():
    from fedderm.node import NodeConfigError, parse_node_config

    assert parse_node_config({}).insecure_reproducible_noise is False
    assert parse_node_config({REPRODUCIBLE: True}).insecure_reproducible_noise is True
    with pytest.raises(NodeConfigError, match=f"'{REPRODUCIBLE}'"):
        parse_node_config({REPRODUCIBLE: "true"})
