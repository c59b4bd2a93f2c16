"""Fine-tuning on a centre held out of the federation (``holdout-centre``, paper 004 Table XI)."""

import pytest
import torch
from fake_grid import FakeGrid
from flwr.app import Message, RecordDict

import registry
import server_app
from clients.holdout import build_network, transfer
from fedderm.config import ConfigError
from fedderm.flbt import batchnorm_keys, build_projected_net, split_state
from fedderm.models import create_model
from fedderm.results import RunRecorder
from strategies.holdout import HoldoutError, HoldoutGrid, finetune_holdout, holdout_nodes

TINY = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "num-server-rounds": 1,
    "local-epochs": 1,
    "batch-size": 8,
    "optimizer": "sgd",
    "lr": 0.03,
    "holdout-epochs": 2,
}


def config(tmp_path, **overrides):
    return {**TINY, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out"), **overrides}


def test_the_held_out_node_is_invisible_and_unreachable_for_a_method(tmp_path):
    rc = config(tmp_path, method="fedavg", **{"holdout-centre": "2"})
    cfg = registry.load_config(rc)
    grid = FakeGrid(rc, 3)
    infos = {nid: {"partition-id": pid, "site": ""} for nid, pid in grid.partition_of_node.items()}
    held = holdout_nodes(cfg, infos)
    assert [grid.partition_of_node[n] for n in held] == [2]
    federation = HoldoutGrid(grid, held)
    assert sorted(federation.get_node_ids()) == sorted(n for n in grid.get_node_ids() if n not in held)
    recorder = RunRecorder(tmp_path / "run", cfg.method, cfg.to_flat())
    server_app.run_supervised(federation, cfg, recorder, ["a", "b", "c", "d", "e"])  # a whole federated run
    assert grid.sent and not [m for m in grid.sent if m.metadata.dst_node_id in held]
    assert set(recorder.final["per_client"]) == {"0", "1"}
    with pytest.raises(HoldoutError, match="held-out centre"):  # a strategy cannot reach it even by node id
        federation.send_and_receive([Message(RecordDict(), dst_node_id=held[0], message_type="train")])
    # afterwards the held-out centre fine-tunes the final global model and reports its own rows
    result = finetune_holdout(grid, cfg, recorder, held[0], ["a", "b", "c", "d", "e"])
    assert result["centre"] == "2" and result["start"] == "model-best.pt" and 1 <= result["best_epoch"] <= 2
    assert [m.metadata.message_type for m in grid.sent if m.metadata.dst_node_id in held] == ["train.holdout"]
    sent = (
        next(m for m in grid.sent if m.metadata.dst_node_id in held).content["arrays"].to_torch_state_dict()
    )
    best = torch.load(recorder.run_dir / "model-best.pt")
    assert sent.keys() == best.keys() and all(torch.equal(sent[k], best[k]) for k in best)
    splits = [r["split"] for r in recorder.rounds]
    assert splits.count("holdout-val") == 2 and splits.count("holdout-test") == 1
    assert recorder.extra["holdout"]["final"]["per_client"]["2"]["accuracy"] == result["final"]["accuracy"]
    assert (recorder.run_dir / "holdout_table.txt").exists() and (
        recorder.run_dir / "pr_curve_client2.png"
    ).exists()


def test_holdout_centre_by_site_name_and_bad_names_fail(tmp_path):
    cfg = registry.load_config({"holdout-centre": "databiox"})
    infos = {5: {"partition-id": 0, "site": "c1"}, 9: {"partition-id": 7, "site": "databiox"}}
    assert holdout_nodes(cfg, infos) == [9]
    with pytest.raises(ConfigError, match="holdout-centre"):
        holdout_nodes(registry.load_config({"holdout-centre": "3"}), infos)
    with pytest.raises(ConfigError, match="holdout-centre"):  # SiFT's model has no transferable global model
        registry.load_config({"method": "sift", "holdout-centre": "2"})
    with pytest.raises(ConfigError, match="holdout-epochs"):
        registry.load_config({"holdout-epochs": 0})


def test_transfer_keeps_everything_but_the_output_layer():
    torch.manual_seed(0)
    glob = build_projected_net("tiny-cnn", 4, 16)
    torch.manual_seed(1)
    local = build_network(
        "projected", "tiny-cnn", 3, 16, 128
    )  # the held-out centre has 3 classes (004: 4 -> 3)
    head_before = local.head.weight.clone()
    assert transfer(local, glob.state_dict()) == []
    state = local.state_dict()
    assert all(torch.equal(state[k], v) for k, v in glob.state_dict().items() if not k.startswith("head."))
    assert local.head.weight.shape == (3, 128) and torch.equal(local.head.weight, head_before)
    # FedBN's global model has no BatchNorm arrays: those start fresh on the held-out centre
    clf = create_model("tiny-cnn", 5, 16)
    shared, _ = split_state(clf.state_dict(), batchnorm_keys(clf))
    fresh = build_network("classifier", "tiny-cnn", 5, 16, 128)
    assert set(transfer(fresh, shared)) == batchnorm_keys(fresh)
    with pytest.raises(ValueError, match="lacks"):  # anything else missing is an error
        transfer(
            build_network("classifier", "tiny-cnn", 5, 16, 128),
            {k: v for k, v in shared.items() if not k.startswith("backbone.0.0")},
        )
