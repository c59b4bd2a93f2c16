"""The SSL variants of 004 Tables V-X as ``ssl.*`` keys of ``ssl-flbt``, driven through the real
strategy and client handlers on an in-process grid (tests/fake_grid.py)."""

import pytest
import torch
from fake_grid import FakeGrid
from flwr.app import ArrayRecord, Message, RecordDict

import registry
from clients import ssl_flbt as ssl_client
from clients.state import client_state
from fedderm.config import ConfigError
from fedderm.flbt import build_projected_net
from fedderm.results import RunRecorder
from fedderm.ssl_pseudo import backbone_arrays, encoder_prefix, original_ssl_network
from strategies import ssl_flbt

CLASSES = ["a", "b", "c", "d", "e"]
TINY = {
    "method": "ssl-flbt",
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "num-server-rounds": 1,
    "local-epochs": 1,
    "batch-size": 8,
    "optimizer": "sgd",
    "lr": 0.03,
    "ssl.rounds": 2,
    "ssl.epochs": 1,
    "ssl.gan-steps": 3,
    "ssl.pseudo-per-centre": 8,
    "ssl.gan-width": 16,
}


def run(tmp_path, **overrides):
    rc = {**TINY, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out"), **overrides}
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 2)
    recorder = RunRecorder(tmp_path / "run", cfg.method, cfg.to_flat())
    ssl_flbt.run(grid, cfg, recorder, CLASSES)
    return grid, recorder, cfg


def carries(msg) -> bool:
    """True when the message holds model weights (an empty ArrayRecord holds none)."""
    return "arrays" in msg.content and len(msg.content["arrays"]) > 0


def kinds(grid, kind):
    return [m for m in grid.sent if m.metadata.message_type == kind]


def initial_encoder(cfg):
    torch.manual_seed(cfg.seed)
    net = original_ssl_network(cfg.model, cfg.image_size, cfg.option("ssl.tasks"))
    return backbone_arrays(net.state_dict(), encoder_prefix(cfg.option("ssl.tasks")))


def test_ssl_fed_r_pretrains_each_centre_alone_and_starts_fl_from_its_own_encoder(tmp_path):
    """SSL-Fed-R: restoration on each centre's own images, nothing averaged, no pre-trained
    weights ever reach the server; stage 2 (FedAvg) starts on every centre from its own encoder."""
    grid, recorder, cfg = run(
        tmp_path, **{"ssl.pretrain": "local", "ssl.tasks": "restoration", "ssl.finetune": "fedavg"}
    )
    pre = kinds(grid, "train.pretrain")
    assert len(pre) == 2 * 2 and not kinds(grid, "train.gan")
    assert all(carries(m) for m in pre[:2]) and not any(carries(m) for m in pre[2:])
    pre_replies = [r for r in grid.replies if "ssl_mse" in r.content["metrics"]]
    assert len(pre_replies) == 4 and not any(carries(r) for r in pre_replies)
    server = torch.load(recorder.run_dir / "ssl-encoder.pt")
    assert all(
        torch.equal(server[k], v) for k, v in initial_encoder(cfg).items()
    )  # the server's is the initial one
    net = build_projected_net(cfg.model, 5, cfg.image_size)
    net.encoder.load_state_dict(server)
    own = []
    for node, context in grid.contexts.items():
        sent = Message(
            RecordDict({"arrays": ArrayRecord(net.state_dict())}), dst_node_id=node, message_type="train"
        )
        msg = ssl_client.with_own_encoder(sent, context)
        swapped = msg.content["arrays"].to_torch_state_dict()
        mine = backbone_arrays(client_state(context).tensors(ssl_client.OWN_SSL), "encoder.")
        assert all(torch.equal(swapped[f"encoder.{k}"], v) for k, v in mine.items())
        assert torch.equal(swapped["head.weight"], net.state_dict()["head.weight"])  # the rest as sent
        own.append(mine)
    key = next(iter(own[0]))
    assert not torch.equal(own[0][key], own[1][key])  # two different centre models
    assert [r["split"] for r in recorder.rounds].count("pretrain") == 2 and recorder.final[
        "per_client"
    ].keys() == {"0", "1"}


def test_fedssl_s_averages_simclr_pretraining_and_starts_from_the_global_encoder(tmp_path):
    grid, recorder, cfg = run(
        tmp_path, **{"ssl.pretrain": "federated", "ssl.tasks": "simclr", "ssl.finetune": "fedavg"}
    )
    pre = kinds(grid, "train.pretrain")
    assert len(pre) == 4 and all(carries(m) for m in pre)
    pretrained = torch.load(recorder.run_dir / "model-pretrained.pt")
    server = torch.load(recorder.run_dir / "ssl-encoder.pt")
    assert set(server) == set(backbone_arrays(pretrained, "")) and all(
        torch.equal(server[k], pretrained[k]) for k in server
    )
    first = next(m for m in grid.sent if m.metadata.message_type == "train")
    sent = first.content["arrays"].to_torch_state_dict()
    assert all(torch.equal(sent[f"encoder.{k}"], v) for k, v in server.items())
    assert not all(torch.equal(v, initial_encoder(cfg)[k]) for k, v in server.items())
    # FL stage is FedAvg (mu = 0)
    assert first.content["config"]["flbt-mu"] == 0.0


def test_ssl_l_ft_fine_tunes_the_server_model_on_each_centre_without_fl(tmp_path):
    grid, recorder, cfg = run(tmp_path, **{"ssl.finetune": "local"})
    assert len(kinds(grid, "train.gan")) == 2
    trains = kinds(grid, "train")
    assert trains and all(carries(m) == (m.content["config"]["server-round"] == 1) for m in trains)
    train_replies = [r for r in grid.replies if "train_loss" in r.content["metrics"]]
    assert train_replies and not any(carries(r) for r in train_replies)  # nothing uploaded
    start = trains[0].content["arrays"].to_torch_state_dict()
    server = torch.load(recorder.run_dir / "ssl-encoder.pt")
    assert all(torch.equal(start[f"encoder.{k}"], v) for k, v in server.items())
    assert all("best-round" in m for m in recorder.final["per_client"].values())


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"ssl.tasks": "simclr"}, "ssl.tasks"),
        ({"ssl.pretrain": "local", "ssl.tasks": "both"}, "ssl.tasks"),
        ({"ssl.finetune": "fedprox"}, "ssl.finetune"),
        ({"ssl.fid-keep": 5, "ssl.fid-checkpoints": 4}, "ssl.fid-keep"),
        ({"ssl.gan-lr": 0.0}, "ssl.gan-lr"),
        ({"flbt.normalize": "layernorm"}, "flbt.normalize"),
        ({"moon.tau": 0.0}, "moon.tau"),
        ({"flbt.mu": -1.0}, "flbt.mu"),
    ],
)
def test_bad_004_options_fail_when_the_config_is_parsed(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        registry.load_config({"method": "fedavg", **bad})  # before anything starts, whatever the method
