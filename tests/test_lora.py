"""LoRA federated fine-tuning (``peft="lora"``, fedderm/lora.py, strategies/peft.py, clients/peft.py)
and ``init-checkpoint``: what travels, what stays frozen, what stays on the hospitals, resume."""

import copy
import json

import pytest
import torch

import registry
from bench.loop_grid import run_app
from fedderm.config import ConfigError
from fedderm.inference import load_model
from fedderm.lora import add_lora, load_init_checkpoint, merged_state, split_keys, trainable_keys
from fedderm.models import create_model
from fedderm.train import predict, train_supervised
from strategies import common

SMALL = {
    "method": "random-init",
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "batch-size": 8,
    "finetune-rounds": 2,
    "finetune-epochs": 1,
    "finetune-lr": 0.01,
    "peft": "lora",
    "lora-rank": 2,
    "lora-alpha": 4.0,
}


def small(tmp_path, **overrides) -> dict:
    return {**SMALL, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out"), **overrides}


def recording_app(log: list):
    """The real ClientApp, recording every (message, reply) pair it handles."""
    from client_app import app

    def handle(msg, context):
        sent = copy.deepcopy(msg)
        reply = app(msg, context)
        log.append((sent, copy.deepcopy(reply)))
        return reply

    return handle


def array_keys(msg) -> set[str]:
    return {k for record in msg.content.array_records.values() for k in record.keys()}


def lora_model(name: str, personal: bool = False):
    torch.manual_seed(0)
    return add_lora(create_model(name, 5, 16), rank=2, alpha=4, personal=personal, seed=0)


@pytest.mark.parametrize("name", ["tiny-cnn", "vit-micro"])
def test_merged_model_computes_what_the_adapted_model_computes(name):
    """model.pt is W0 + (α/r)·B·A in the plain classifier: the same outputs as the adapted model."""
    model = lora_model(name)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if ".lora_B." in key:
                p.copy_(0.05 * torch.randn_like(p))
    plain = create_model(name, 5, 16)
    plain.load_state_dict(merged_state(model), strict=True)
    x = torch.randn(4, 3, 16, 16)
    model.eval(), plain.eval()
    assert torch.allclose(plain(x), model(x), atol=1e-5)
    assert not torch.allclose(plain(x), create_model(name, 5, 16).eval()(x), atol=1e-3)


def test_default_targets_are_attention_for_vits_and_convolutions_else():
    vit = split_keys(lora_model("vit-micro"), False)["shared"]
    assert {k.split(".lora_")[0] for k in vit if ".lora_" in k} == {
        f"backbone.blocks.{i}.attn.{m}" for i in (0, 1) for m in ("qkv", "proj")
    }
    cnn = split_keys(lora_model("tiny-cnn"), False)["shared"]
    assert {k.split(".lora_")[0] for k in cnn if ".lora_" in k} == {f"backbone.{i}.0" for i in range(4)}
    assert {k for k in cnn if ".lora_" not in k} == {"head.weight", "head.bias"}


@pytest.mark.parametrize("name", ["tiny-cnn", "vit-micro"])
def test_frozen_backbone_is_bitwise_unchanged_by_local_training(name):
    """Weights and BatchNorm running statistics of the frozen backbone stay as they were; the
    adapters and the head move."""
    model = lora_model(name)
    keys = split_keys(model, False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images = torch.randint(0, 256, (16, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(16) % 5
    train_supervised(model, images, labels, epochs=2, batch_size=8, lr=0.05, optimizer="adam", seed=1)
    after = model.state_dict()
    assert keys["frozen"] and all(torch.equal(before[k], after[k]) for k in keys["frozen"])
    assert any(k.endswith("running_mean") for k in keys["frozen"]) == (name == "tiny-cnn")
    assert all(not torch.equal(before[k], after[k]) for k in keys["shared"] if ".lora_B." in k or "head" in k)


def test_only_adapters_and_head_travel_and_model_pt_is_a_plain_classifier(tmp_path):
    log = []
    run_dir = run_app(small(tmp_path, **{"run-name": "r"}), num_clients=2, client_app=recording_app(log))
    trainable = set(trainable_keys(lora_model("tiny-cnn")))
    kinds = [m.metadata.message_type for m, _ in log]
    backbone = [(m, r) for m, r in log if m.metadata.message_type == "query.peft_backbone"]
    assert len(backbone) == 2  # once per client
    frozen = array_keys(backbone[0][0])
    assert frozen and not frozen & trainable and all(not array_keys(r) for _, r in backbone)
    rounds = [(m, r) for m, r in log if m.metadata.message_type in ("train.finetune", "evaluate")]
    assert kinds.count("train.finetune") == 4 and kinds.count("evaluate") == 2 * 4  # val 0-2, test
    for msg, reply in rounds:
        assert array_keys(msg) == trainable, msg.metadata.message_type  # server -> client
        if msg.metadata.message_type.startswith("train"):
            assert array_keys(reply) == trainable  # client -> server
    summary = json.loads((run_dir / "summary.json").read_text())
    sent = [e for e in summary["bytes_per_round"] if e["stage"] == "finetune"]
    train_bytes = sum(
        m.content.array_records["arrays"].count_bytes()
        for m, _ in rounds
        if "train" in m.metadata.message_type
    )
    assert sum(e["down"] for e in sent) == train_bytes
    assert summary["peft"]["backbone-transfer"]["bytes"] == sum(
        m.content.array_records["arrays"].count_bytes() for m, _ in backbone
    )
    assert summary["peft"]["kept-on-clients"] == "nothing"
    clf = load_model(run_dir / "model-best.pt")  # adapters merged: a plain tiny-cnn
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    assert clf.probabilities(images).shape == (3, 5)
    assert torch.allclose(clf.probabilities(images).sum(1), torch.ones(3))
    assert predict(clf.model, images).shape == (3, 5)


def test_personal_adapters_never_reach_the_server(tmp_path):
    log = []
    run_dir = run_app(
        small(tmp_path, **{"run-name": "p", "peft-personal": True}),
        num_clients=2,
        client_app=recording_app(log),
    )
    keys = split_keys(lora_model("tiny-cnn", personal=True), True)
    assert keys["personal"] and all(".personal." in k or k.startswith("head.") for k in keys["personal"])
    replies = [r for _, r in log]
    assert all(not array_keys(r) & set(keys["personal"]) for r in replies)  # nothing personal comes back
    for msg, reply in log:
        if msg.metadata.message_type in ("train.finetune", "evaluate"):
            assert array_keys(msg) == set(keys["shared"])
        if msg.metadata.message_type == "train.finetune":
            assert array_keys(reply) == set(keys["shared"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peft"]["kept-on-clients"] == "a personal LoRA adapter and the head"
    assert set(summary["final"]["per_client"]) == {"0", "1"}
    assert not (run_dir / "model.pt").exists() and (run_dir / "model-shared.pt").exists()
    shared = torch.load(run_dir / "model-shared.pt")
    torch.manual_seed(0)
    create_model("tiny-cnn", 5, 16).backbone.load_state_dict(
        {k[len("backbone.") :]: v for k, v in shared.items()}, strict=True
    )


class Killed(Exception):
    pass


def test_personal_run_resumes_exactly(tmp_path, monkeypatch):
    """Killed before the round-3 checkpoint and resumed: the same rounds, test and shared model as
    an uninterrupted run (the clients' personal adapters come back from their state)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = small(tmp_path, **{"peft-personal": True, "finetune-rounds": 3})
    full = run_app({**base, "run-name": "full"})
    save = common.save_checkpoint

    def die(run_dir, stage, server_round, payload, keep=3):
        if server_round == 3:
            raise Killed
        return save(run_dir, stage, server_round, payload, keep)

    monkeypatch.setattr(common, "save_checkpoint", die)
    with pytest.raises(Killed):
        run_app({**base, "run-name": "crashed"})
    monkeypatch.setattr(common, "save_checkpoint", save)
    crashed = tmp_path / "out" / "crashed"
    resumed = run_app({"resume": str(crashed)})
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, resumed))
    assert a["rounds"] == b["rounds"] and a["final"] == b["final"] and a["best_round"] == b["best_round"]
    wa, wb = (torch.load(d / "model-shared.pt") for d in (full, resumed))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# -- init-checkpoint ------------------------------------------------------------------------------------
def test_init_checkpoint_loads_every_format_and_names_a_wrong_key(tmp_path):
    torch.manual_seed(1)
    source = create_model("vit-micro", 5, 16)
    want = source.backbone.state_dict()
    torch.save(source.state_dict(), tmp_path / "model.pt")  # a fedderm classifier (backbone.*, head.*)
    torch.save({"model": dict(want), "epoch": 3}, tmp_path / "wrapped.pth")  # {"model": ...}
    torch.save(
        {**want, "head.weight": torch.zeros(7, 64), "head.bias": torch.zeros(7)}, tmp_path / "timm.pth"
    )
    for name, head in (
        ("model.pt", "and head"),
        ("wrapped.pth", "no fedderm head"),
        ("timm.pth", "other shapes"),
    ):
        torch.manual_seed(2)
        model = create_model("vit-micro", 5, 16)
        note = load_init_checkpoint(model, tmp_path / name)
        assert head in note
        assert all(torch.equal(model.backbone.state_dict()[k], want[k]) for k in want)
    # an official MAE encoder checkpoint: final norm instead of timm's fc_norm (which starts fresh)
    mae = {k: v for k, v in want.items() if not k.startswith("fc_norm.")}
    mae.update({"norm.weight": torch.rand(64), "norm.bias": torch.rand(64)})
    torch.save({"model": mae}, tmp_path / "mae.pth")
    model = create_model("vit-micro", 5, 16)
    load_init_checkpoint(model, tmp_path / "mae.pth")
    got = model.backbone.state_dict()
    assert all(torch.equal(got[k], mae[k]) for k in got if not k.startswith("fc_norm."))
    assert torch.equal(got["fc_norm.weight"], torch.ones(64))
    bad = {
        ("blocks.0.attn.qkvv.weight" if k == "blocks.0.attn.qkv.weight" else k): v for k, v in want.items()
    }
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError) as err:
        load_init_checkpoint(create_model("vit-micro", 5, 16), tmp_path / "bad.pt")
    message = str(err.value)
    assert "\n" not in message and "'blocks.0.attn.qkv.weight'" in message and "init-checkpoint" in message
    renamed = {k.replace("qkv", "qkvv"): v for k, v in source.state_dict().items()}
    torch.save(renamed, tmp_path / "model-bad.pt")  # a fedderm model.pt: the backbone.* reading is named
    with pytest.raises(ValueError, match=r"missing key 'blocks.0.attn.qkv.weight'"):
        load_init_checkpoint(create_model("vit-micro", 5, 16), tmp_path / "model-bad.pt")
    torch.save({**want, "pos_embed": torch.zeros(1, 3, 64)}, tmp_path / "shape.pt")
    with pytest.raises(ValueError, match=r"'pos_embed' has shape \[1, 3, 64\]"):
        load_init_checkpoint(create_model("vit-micro", 5, 16), tmp_path / "shape.pt")


def test_init_checkpoint_and_peft_are_refused_where_they_do_not_apply():
    def load(**kw):
        return registry.load_config({"model": "tiny-cnn", **kw})

    with pytest.raises(ConfigError, match="'peft'.*localcl"):
        load(method="localcl", peft="lora")
    with pytest.raises(ConfigError, match="finetune='federated'"):
        load(method="random-init", peft="lora", finetune="local")
    with pytest.raises(ConfigError, match="'init-checkpoint'.*fedclf"):
        load(method="fedclf", **{"init-checkpoint": "x.pt"})
    with pytest.raises(ConfigError, match="'peft-personal'"):
        load(method="random-init", **{"peft-personal": True})
    assert load(method="random-init", peft="lora", **{"lora-rank": 3}).lora_rank == 3


def test_lora_after_fedema_pretraining_sends_only_adapters_and_head(tmp_path):
    """FedEMA's fine-tuning stage is the shared one: after two pre-training rounds (the second
    applies the divergence-aware EMA) the fine-tuning messages carry only adapters and head."""
    log = []
    config = small(
        tmp_path,
        **registry.smallest_run("fedema", **{"num-server-rounds": 2, "peft": "lora", "lora-rank": 2}),
    )
    run_dir = run_app(config, num_clients=2, client_app=recording_app(log))
    trainable = set(trainable_keys(lora_model("tiny-cnn")))
    kinds = [m.metadata.message_type for m, _ in log]
    assert kinds.count("train.pretrain") == 2 * 2 and kinds.count("query.peft_backbone") == 2
    finetune = [(m, r) for m, r in log if m.metadata.message_type == "train.finetune"]
    assert finetune
    for msg, reply in finetune:
        assert array_keys(msg) == trainable and array_keys(reply) == trainable
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peft"]["kept-on-clients"] == "nothing"
