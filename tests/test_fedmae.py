"""FedMAE / Fed-MAE (000 §IV, 003 §III): the MAE, the knowledge split, checkpoints, end to end."""

import argparse
import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

import registry
import sim
from clients import fedmae as mae_client
from clients.state import client_state
from fedderm import sweep as fs
from fedderm.config import ConfigError, default_config
from fedderm.mae import (
    EXCLUDE_PRESETS,
    PAPER_DECODER,
    MaskedAutoencoderViT,
    build_mae,
    excluded_keys,
    load_mae_checkpoint,
    masked_patch_mse,
    patchify,
    random_masking,
    sincos_2d,
    unpatchify,
    vit_backbone_state,
)
from fedderm.methods.fedmae import DECODER_KEYS
from fedderm.models import create_model
from fedderm.state_store import StateStore
from strategies.fedmae import FedMAEStrategy, mae_backbone_state
from strategies.finetune import classifier_from_pretrained
from wire import LOCAL_RECORD

ROOT = Path(__file__).resolve().parents[1]
MICRO = {
    "model": "vit-micro",
    "image-size": 32,
    "fedmae.decoder-embed-dim": 32,
    "fedmae.decoder-depth": 1,
    "fedmae.decoder-num-heads": 2,
}


def micro_mae(**kw) -> MaskedAutoencoderViT:
    return MaskedAutoencoderViT(
        img_size=32,
        patch_size=8,
        embed_dim=64,
        depth=2,
        num_heads=2,
        decoder_embed_dim=32,
        decoder_depth=1,
        decoder_num_heads=2,
        **kw,
    )


# -- the model ------------------------------------------------------------------------------------
def test_patchify_order_is_row_column_channel():
    p, c = 4, 3
    imgs = torch.arange(2 * c * 8 * 8, dtype=torch.float32).reshape(2, c, 8, 8)
    x = patchify(imgs, p)
    assert x.shape == (2, 4, p * p * c)
    for n in range(2):
        for gi in range(2):  # patch row
            for gj in range(2):  # patch column
                patch = x[n, gi * 2 + gj]  # patches in row-major order
                for r in range(p):
                    for q in range(p):
                        for ch in range(c):
                            assert patch[(r * p + q) * c + ch] == imgs[n, ch, gi * p + r, gj * p + q]
    assert torch.equal(unpatchify(x, p, c), imgs)


def test_loss_is_the_masked_patch_mse_of_the_equation():
    g = torch.Generator().manual_seed(3)
    target, pred = torch.randn(2, 5, 12, generator=g), torch.randn(2, 5, 12, generator=g)
    mask = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.float32)
    for norm_pix in (False, True):
        total, count = 0.0, 0
        for n in range(2):
            for i in range(5):
                if not mask[n, i]:
                    continue
                t = target[n, i].double().tolist()
                if norm_pix:
                    mean = sum(t) / len(t)
                    var = sum((v - mean) ** 2 for v in t) / (len(t) - 1)  # unbiased
                    t = [(v - mean) / math.sqrt(var + 1e-6) for v in t]
                total += sum((pv - tv) ** 2 for pv, tv in zip(pred[n, i].tolist(), t)) / len(t)
                count += 1
        expected = total / count
        assert masked_patch_mse(target, pred, mask, norm_pix).item() == pytest.approx(expected, rel=1e-5)
    # unmasked patches do not count
    pred2 = pred.clone()
    pred2[0, 1] += 100
    assert masked_patch_mse(target, pred2, mask).item() == pytest.approx(
        masked_patch_mse(target, pred, mask).item()
    )


def test_forward_loss_patchifies_the_image_before_the_equation():
    model = micro_mae(norm_pix_loss=True)
    imgs = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    loss, pred, mask = model(imgs, 0.75, torch.Generator().manual_seed(1))
    assert pred.shape == (2, 16, 8 * 8 * 3) and mask.sum(1).tolist() == [12.0, 12.0]
    assert loss.item() == pytest.approx(
        masked_patch_mse(patchify(imgs, 8), pred, mask, True).item(), rel=1e-6
    )


def test_random_masking_keeps_the_lowest_noise_and_restores_order():
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    kept, mask, ids_restore = random_masking(x, 0.75, torch.Generator().manual_seed(5))
    noise = torch.rand(2, 8, generator=torch.Generator().manual_seed(5))
    order = torch.argsort(noise, dim=1)
    assert kept.shape == (2, 2, 3)
    for n in range(2):
        assert torch.equal(kept[n], x[n, order[n, :2]])
        assert mask[n].tolist() == [0.0 if i in order[n, :2].tolist() else 1.0 for i in range(8)]
        assert torch.equal(order[n][ids_restore[n]], torch.arange(8))


def test_sincos_position_embedding_matches_the_formula():
    dim, grid = 16, 3
    emb = sincos_2d(dim, grid, cls_token=True)
    assert emb.shape == (1 + grid * grid, dim) and not emb[0].any()
    omega = [1 / 10000 ** (k / (dim / 4)) for k in range(dim // 4)]
    for row in range(grid):
        for col in range(grid):
            e = emb[1 + row * grid + col]
            expected = (
                [math.sin(col * w) for w in omega]
                + [math.cos(col * w) for w in omega]
                + [math.sin(row * w) for w in omega]
                + [math.cos(row * w) for w in omega]
            )
            assert np.allclose(e, expected, atol=1e-6)
    model = micro_mae()
    assert not model.pos_embed.requires_grad and not model.decoder_pos_embed.requires_grad
    assert np.allclose(model.pos_embed[0].numpy(), sincos_2d(64, 4, True))


def test_reference_names():
    names = {k.split(".")[0] for k in micro_mae().state_dict()}
    assert names == {
        "patch_embed",
        "cls_token",
        "pos_embed",
        "blocks",
        "norm",
        "decoder_embed",
        "mask_token",
        "decoder_pos_embed",
        "decoder_blocks",
        "decoder_norm",
        "decoder_pred",
    }
    for method in (
        "patchify",
        "unpatchify",
        "random_masking",
        "forward_encoder",
        "forward_decoder",
        "forward_loss",
    ):
        assert callable(getattr(MaskedAutoencoderViT, method))


def decoder_of(m: MaskedAutoencoderViT) -> tuple[int, int, int]:
    return m.decoder_embed.out_features, len(m.decoder_blocks), m.decoder_blocks[0].attn.num_heads


def n_params(m: MaskedAutoencoderViT, decoder: bool) -> int:
    return sum(
        p.numel() for k, p in m.named_parameters() if k.startswith(("decoder_", "mask_token")) == decoder
    )


@pytest.mark.parametrize(
    "name, encoder, decoder",
    [
        ("vit-micro", (64, 2, 8), (32, 1, 1)),
        ("vit-tiny", (192, 12, 8), (128, 8, 4)),
        ("vit-small", (384, 12, 8), (256, 8, 8)),
        ("vit-base", (768, 12, 16), (512, 8, 16)),  # the MAE reference's mae_vit_base_patch16_dec512d8b
    ],
)
def test_the_default_decoder_is_sized_to_its_encoder_and_vit_base_gets_the_papers(name, encoder, decoder):
    """With the decoder keys unset the decoder keeps the reference's ViT-B proportions (width and
    blocks 2/3 of the encoder's, 32-wide heads), so it stays about a third of the encoder's
    parameters at every size; the run config records the sizes (config.json is ``to_flat``)."""
    cfg = registry.load_config({"method": "fedmae", "model": name, "image-size": 32})
    m = build_mae(cfg)
    assert (m.cls_token.shape[-1], len(m.blocks), m.patch_size) == encoder
    assert decoder_of(m) == decoder
    flat = cfg.to_flat()
    assert tuple(flat[k] for k in DECODER_KEYS) == decoder
    assert 0.15 < n_params(m, decoder=True) / n_params(m, decoder=False) < 0.35


def test_a_set_decoder_wins_and_a_width_alone_takes_heads_that_divide_it():
    cfg = registry.load_config({**MICRO, "method": "fedmae"})
    assert decoder_of(build_mae(cfg)) == (32, 1, 2)  # all three given: as given
    width_only = registry.load_config(
        {"method": "fedmae", "model": "vit-micro", "fedmae.decoder-embed-dim": 96}
    )
    assert tuple(width_only.option(k) for k in DECODER_KEYS) == (96, 1, 3)
    paper = registry.load_config({"method": "fedmae", "model": "vit-micro", **PAPER_DECODER})
    assert decoder_of(build_mae(paper)) == (512, 8, 16)


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"fedmae.decoder-embed-dim": 30}, "fedmae.decoder-embed-dim"),
        ({"fedmae.decoder-embed-dim": 32, "fedmae.decoder-num-heads": 3}, "fedmae.decoder-embed-dim"),
        ({"fedmae.decoder-depth": 0}, "fedmae.decoder-depth"),
        ({"fedmae.decoder-num-heads": -2}, "fedmae.decoder-num-heads"),
    ],
)
def test_a_decoder_that_cannot_be_built_is_refused_when_the_config_is_read(bad, key):
    """Before a run starts (sim.py, the ServerApp, each ClientApp), naming the key."""
    with pytest.raises(ConfigError, match=f"'{key}'"):
        registry.load_config({"method": "fedmae", "model": "vit-micro", **bad})


def test_sizes_follow_the_registered_vits():
    with pytest.raises(ConfigError, match="'model'"):
        build_mae(registry.load_config({"method": "fedmae", "model": "tiny-cnn"}))
    with pytest.raises(ConfigError, match="fedmae.mask-ratio"):
        build_mae(registry.load_config({**MICRO, "method": "fedmae", "fedmae.mask-ratio": 1.0}))


def test_encoder_transfers_to_the_timm_classifier():
    """pos_embed (class-token row first), patch_embed and blocks line up with timm's ViT: the
    classifier's tokens equal the MAE encoder's on an unmasked image (up to the shuffle)."""
    mae = micro_mae()
    clf = create_model("vit-micro", 5, 32)
    state = vit_backbone_state(mae.state_dict(), clf.backbone.state_dict().keys())
    clf.backbone.load_state_dict(state, strict=True)
    assert torch.equal(clf.backbone.fc_norm.weight, torch.ones(64))  # fresh, as the MAE reference fine-tunes
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    mae.eval(), clf.eval()
    with torch.no_grad():
        latent, mask, ids_restore = mae.forward_encoder(x, 0.0, torch.Generator().manual_seed(1))
        tokens = clf.backbone.forward_features(x)  # (N, 1 + L, D), timm's norm is Identity under avg pooling
    assert not mask.any()
    ids_shuffle = torch.argsort(ids_restore, dim=1)
    expected = mae.norm(
        torch.cat([tokens[:, :1], torch.stack([tokens[n, 1:][ids_shuffle[n]] for n in range(2)])], 1)
    )
    assert torch.allclose(latent, expected, atol=1e-5)


def test_vit_pool_token_classifies_the_class_tokens_output_of_the_pre_trained_encoder():
    """``vit-pool="token"`` (000 §IV-A: the class token's output is the image's representation): the
    classifier's features are the MAE encoder's normalised class-token output (its final norm carried
    over); ``avg`` (the other methods' default) is the mean of the patch tokens under a fresh norm."""
    mae = micro_mae()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    feats, clfs = {}, {}
    for pool in ("avg", "token"):
        cfg = registry.load_config({**MICRO, "method": "fedmae", "vit-pool": pool})
        clfs[pool] = classifier_from_pretrained(cfg, 5, mae.state_dict(), mae_backbone_state(cfg, 5)).eval()
        with torch.no_grad():
            feats[pool] = clfs[pool].forward_features(x)
    mae.eval()
    with torch.no_grad():
        latent, _, _ = mae.forward_encoder(x, 0.0, torch.Generator().manual_seed(1))
        tokens = clfs["avg"].backbone.forward_features(x)  # un-normalised under average pooling
        mean_of_patches = clfs["avg"].backbone.fc_norm(tokens[:, 1:].mean(1))
    assert torch.allclose(feats["token"], latent[:, 0], atol=1e-5)  # the encoder's class token, normalised
    assert torch.allclose(feats["avg"], mean_of_patches, atol=1e-5)
    assert not torch.allclose(feats["avg"], feats["token"], atol=1e-2)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "fedavg", "model": "tiny-cnn"}, r"'vit-pool' is 'token', which needs a ViT model"),
        ({"method": "fedclf", "model": "vit-micro"}, r"'vit-pool' is 'token'.*one of the methods"),
        ({"method": "fedmae", "model": "vit-micro", "vit-pool": "cls"}, r"'vit-pool' must be one of"),
    ],
)
def test_vit_pool_token_is_refused_where_the_classifier_would_ignore_it(config, match):
    with pytest.raises(ConfigError, match=match):
        registry.load_config({"vit-pool": "token", **config})


# -- checkpoints ----------------------------------------------------------------------------------
def reference_named_state(depth=2, dim=64, dec=32, dec_depth=1, grid=4, patch=8, decoder=True):
    """A state dict written by hand with the MAE reference's names and shapes."""
    s = {
        "cls_token": torch.randn(1, 1, dim),
        "pos_embed": torch.randn(1, grid * grid + 1, dim),
        "patch_embed.proj.weight": torch.randn(dim, 3, patch, patch),
        "patch_embed.proj.bias": torch.randn(dim),
    }

    def block(prefix, d):
        return {
            f"{prefix}.norm1.weight": torch.randn(d),
            f"{prefix}.norm1.bias": torch.randn(d),
            f"{prefix}.attn.qkv.weight": torch.randn(3 * d, d),
            f"{prefix}.attn.qkv.bias": torch.randn(3 * d),
            f"{prefix}.attn.proj.weight": torch.randn(d, d),
            f"{prefix}.attn.proj.bias": torch.randn(d),
            f"{prefix}.norm2.weight": torch.randn(d),
            f"{prefix}.norm2.bias": torch.randn(d),
            f"{prefix}.mlp.fc1.weight": torch.randn(4 * d, d),
            f"{prefix}.mlp.fc1.bias": torch.randn(4 * d),
            f"{prefix}.mlp.fc2.weight": torch.randn(d, 4 * d),
            f"{prefix}.mlp.fc2.bias": torch.randn(d),
        }

    for i in range(depth):
        s.update(block(f"blocks.{i}", dim))
    s.update({"norm.weight": torch.randn(dim), "norm.bias": torch.randn(dim)})
    if decoder:
        s.update(
            {
                "mask_token": torch.randn(1, 1, dec),
                "decoder_pos_embed": torch.randn(1, grid * grid + 1, dec),
                "decoder_embed.weight": torch.randn(dec, dim),
                "decoder_embed.bias": torch.randn(dec),
                "decoder_norm.weight": torch.randn(dec),
                "decoder_norm.bias": torch.randn(dec),
                "decoder_pred.weight": torch.randn(patch * patch * 3, dec),
                "decoder_pred.bias": torch.randn(patch * patch * 3),
            }
        )
        for i in range(dec_depth):
            s.update(block(f"decoder_blocks.{i}", dec))
    return s


def test_reference_checkpoint_loads_strictly(tmp_path):
    state = reference_named_state()
    torch.save(
        {"model": state, "epoch": 799, "args": argparse.Namespace(mask_ratio=0.75)}, tmp_path / "full.pth"
    )
    model = micro_mae()
    assert len(load_mae_checkpoint(model, tmp_path / "full.pth")) == len(state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    model.load_state_dict(state, strict=True)  # the same names, strictly

    enc = reference_named_state(decoder=False)  # like the released mae_pretrain_vit_*.pth
    torch.save({"model": enc}, tmp_path / "encoder.pth")
    model = micro_mae()
    decoder_before = model.decoder_pred.weight.clone()
    load_mae_checkpoint(model, tmp_path / "encoder.pth")
    assert torch.equal(model.blocks[1].mlp.fc2.weight, enc["blocks.1.mlp.fc2.weight"])
    assert torch.equal(model.decoder_pred.weight, decoder_before)

    bad = {**state, "head.weight": torch.zeros(2)}
    torch.save({"model": bad}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="unexpected \\['head.weight'\\]"):
        load_mae_checkpoint(micro_mae(), tmp_path / "bad.pth")
    torch.save(state, tmp_path / "raw.pth")
    with pytest.raises(ValueError, match="raw.pth: expected an MAE checkpoint"):
        load_mae_checkpoint(micro_mae(), tmp_path / "raw.pth")


def test_a_checkpoint_with_another_decoder_says_which_decoder_to_set(tmp_path):
    """A full checkpoint whose decoder is not the run's (e.g. the reference's 512 × 8 against a decoder
    sized to a small encoder) is refused naming the file, the keys and the decoder keys to set."""
    torch.save({"model": reference_named_state(dec=64, dec_depth=2)}, tmp_path / "dec64.pth")
    with pytest.raises(
        ValueError,
        match=r"dec64.pth: .*mis-shaped \['decoder_blocks.0.*"
        r"its decoder is 64 wide x 2 blocks, this run's 32 x 1: set "
        r"fedmae.decoder-embed-dim=64 fedmae.decoder-depth=2",
    ):
        load_mae_checkpoint(micro_mae(), tmp_path / "dec64.pth")
    model = MaskedAutoencoderViT(
        32, 8, 3, 64, 2, 2, decoder_embed_dim=64, decoder_depth=2, decoder_num_heads=2
    )
    load_mae_checkpoint(model, tmp_path / "dec64.pth")  # with those keys set, it loads


def test_checkpoint_of_another_grid_resizes_pos_embed(tmp_path):
    enc = reference_named_state(decoder=False, grid=8)  # e.g. trained at 64 px
    torch.save({"model": enc}, tmp_path / "enc64.pth")
    model = micro_mae()
    load_mae_checkpoint(model, tmp_path / "enc64.pth")
    assert model.pos_embed.shape == (1, 17, 64)
    assert torch.equal(model.pos_embed[0, 0], enc["pos_embed"][0, 0])  # the class-token row is kept


# -- the knowledge split: strategy with fake replies ------------------------------------------------
@pytest.fixture(autouse=True)
def _task_identity():
    """Messages are stamped with the running task's identity (sim.py sets it for a run)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 4242, SUPERLINK_NODE_ID
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


class FakeGrid:
    def __init__(self, ids):
        self.ids = ids

    def get_node_ids(self):
        return self.ids


def make_strategy(tmp_path, exclude="cls-token", rounds=2):
    from fedderm.results import RunRecorder

    cfg = registry.load_config(
        {**MICRO, "method": "fedmae", "fedmae.exclude": exclude, "num-server-rounds": rounds}
    )
    return FedMAEStrategy(
        cfg=cfg,
        recorder=RunRecorder(tmp_path / "run", "fedmae", cfg.to_flat()),
        action="pretrain",
        fraction_evaluate=0.0,
        min_train_nodes=2,
        min_available_nodes=2,
    )


def fake_reply(instruction, arrays: dict, n: int, pid: int, local: dict | None = None):
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0, "partition-id": pid}),
        }
    )
    if local is not None:
        content[LOCAL_RECORD] = ArrayRecord({k: Array(v) for k, v in local.items()})
    return Message(content, reply_to=instruction)


def test_strategy_averages_the_synchronised_part_and_the_kept_part_once_at_the_end(tmp_path):
    strategy = make_strategy(tmp_path)
    rng = np.random.default_rng(0)
    glob = {
        "cls_token": rng.normal(size=(1, 1, 4)).astype(np.float32),
        "w": rng.normal(size=3).astype(np.float32),
    }
    clients = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in glob.items()} for _ in range(2)]
    weights = [30, 10]
    arrays = ArrayRecord({k: Array(v) for k, v in glob.items()})

    ins = strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid([11, 12]))
    assert [m.content["config"]["send-local"] for m in ins] == [False, False]
    assert all(m.metadata.message_type == "train.pretrain" for m in ins)
    replies = [fake_reply(m, {"w": c["w"]}, n, i) for i, (m, c, n) in enumerate(zip(ins, clients, weights))]
    new, _ = strategy.aggregate_train(1, replies)
    assert list(new.keys()) == ["cls_token", "w"]
    assert np.allclose(new["w"].numpy(), (30 * clients[0]["w"] + 10 * clients[1]["w"]) / 40)
    assert np.array_equal(new["cls_token"].numpy(), glob["cls_token"])  # not synchronised during the rounds

    ins = strategy.configure_train(2, new, ConfigRecord(), FakeGrid([11, 12]))
    assert [m.content["config"]["send-local"] for m in ins] == [True, True]
    replies = [
        fake_reply(m, {"w": c["w"]}, n, i, local={"cls_token": c["cls_token"]})
        for i, (m, c, n) in enumerate(zip(ins, clients, weights))
    ]
    final, _ = strategy.aggregate_train(2, replies)
    expected = (30 * clients[0]["cls_token"] + 10 * clients[1]["cls_token"]) / 40
    assert np.allclose(final["cls_token"].numpy(), expected)  # averaged once, after the last round


@pytest.mark.parametrize("poisoned", ["arrays", LOCAL_RECORD])
def test_a_rejected_reply_adds_nothing_to_the_final_class_token(tmp_path, poisoned):
    """Only replies that pass screening contribute their kept class token: a reply with a
    non-finite shared weight or a non-finite class token is left out of both means."""
    strategy = make_strategy(tmp_path, rounds=1)
    rng = np.random.default_rng(2)
    glob = {
        "cls_token": rng.normal(size=(1, 1, 4)).astype(np.float32),
        "w": rng.normal(size=3).astype(np.float32),
    }
    clients = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in glob.items()} for _ in range(3)]
    clients[2][{"arrays": "w", LOCAL_RECORD: "cls_token"}[poisoned]][..., 0] = np.nan
    weights = [30, 10, 60]
    arrays = ArrayRecord({k: Array(v) for k, v in glob.items()})
    ins = strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid([11, 12, 13]))
    replies = [
        fake_reply(m, {"w": c["w"]}, n, i, local={"cls_token": c["cls_token"]})
        for i, (m, c, n) in enumerate(zip(ins, clients, weights))
    ]
    final, _ = strategy.aggregate_train(1, replies)
    for key in glob:
        expected = (30 * clients[0][key] + 10 * clients[1][key]) / 40
        assert np.allclose(final[key].numpy(), expected), key
    strategy.record_notes()  # the round loop's record step
    (missing,) = strategy.recorder.extra["missing_clients"]
    assert missing["node-id"] == ins[2].metadata.dst_node_id and "non-finite" in missing["reason"]


def test_exclude_none_is_plain_fedavg(tmp_path):
    strategy = make_strategy(tmp_path, exclude="none")
    rng = np.random.default_rng(1)
    state = {k: v.numpy() for k, v in micro_mae().state_dict().items()}
    arrays = ArrayRecord({k: Array(v) for k, v in state.items()})
    ins = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid([1, 2])))
    replies = [
        fake_reply(m, {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in state.items()}, n, i)
        for i, (m, n) in enumerate(zip(ins, [7, 13]))
    ]
    ours, _ = strategy.aggregate_train(1, copy.deepcopy(replies))
    theirs, _ = FedAvg().aggregate_train(1, copy.deepcopy(replies))
    assert list(ours.keys()) == list(theirs.keys())
    for k in theirs.keys():
        assert np.array_equal(ours[k].numpy(), theirs[k].numpy()), k


# -- the knowledge split: real clients, in process ----------------------------------------------------
def client_context(run_id: int, pid: int, run_config: dict) -> Context:
    """A client's context; sessions are cached per (run id, partition), so each test uses its own run id."""
    return Context(
        run_id=run_id,
        node_id=100 + pid,
        node_config={"partition-id": pid, "num-partitions": 2},
        state=RecordDict(),
        run_config=run_config,
    )


@pytest.mark.parametrize("exclude", ["cls-token", "decoder"])
def test_rounds_with_real_clients_keep_the_excluded_part_local(tmp_path, exclude):
    run_config = {
        **MICRO,
        "method": "fedmae",
        "fedmae.exclude": exclude,
        "num-server-rounds": 2,
        "synthetic-per-class": 8,
        "local-epochs": 1,
        "batch-size": 16,
        "mim.lr": 1e-3,  # pre-training (AdamW: the mim.optimizer default)
        "cache-dir": str(tmp_path / "cache"),
        "seed": 1,
    }
    strategy = make_strategy(tmp_path, exclude=exclude)
    run_id = 5000 + sorted(EXCLUDE_PRESETS).index(exclude)
    contexts = [client_context(run_id, pid, run_config) for pid in (0, 1)]
    torch.manual_seed(0)
    arrays = ArrayRecord(build_mae(strategy.cfg).state_dict())
    for rnd in (1, 2):
        ins = strategy.configure_train(rnd, arrays, ConfigRecord(), FakeGrid([100, 101]))
        replies = [mae_client.pretrain(m, ctx) for m, ctx in zip(ins, contexts)]
        sent = set(replies[0].content["arrays"].keys())
        kept = set(excluded_keys(build_mae(strategy.cfg), exclude))
        assert kept and not sent & kept  # the excluded parameters never travel during the rounds
        assert (LOCAL_RECORD in replies[0].content) == (rnd == 2)
        own = [client_state(ctx).tensors(mae_client.KEPT) for ctx in contexts]
        weights = [int(r.content["metrics"]["num-examples"]) for r in replies]
        arrays, _ = strategy.aggregate_train(rnd, replies)
        if rnd == 1:
            # what each client starts round 2 from: synchronised part identical, excluded part its own
            starts = [
                {k: v.clone() for k, v in mae_client.receive(ctx, arrays)[0].state_dict().items()}
                for ctx in contexts
            ]
            for k in starts[0]:
                if k in kept:
                    assert not torch.equal(starts[0][k], starts[1][k]), k
                    assert all(torch.equal(s[k], o[k]) for s, o in zip(starts, own))
                else:
                    assert torch.equal(starts[0][k], starts[1][k]), k
    final = arrays.to_torch_state_dict()
    for k in kept:  # after the last round the global model holds the clients' (weighted) mean
        expected = (weights[0] * own[0][k] + weights[1] * own[1][k]) / sum(weights)
        assert torch.allclose(final[k], expected, atol=1e-6), k


def test_exclude_presets_select_table_v_parameters():
    model = micro_mae()
    assert excluded_keys(model, "none") == []
    assert excluded_keys(model, "cls-token") == ["cls_token"]
    assert excluded_keys(model, "patch-embed") == ["patch_embed.proj.weight", "patch_embed.proj.bias"]
    assert excluded_keys(model, "decoder-embed") == ["decoder_embed.weight", "decoder_embed.bias"]
    dec = excluded_keys(model, "decoder")
    assert "mask_token" in dec and "decoder_pred.weight" in dec and "decoder_pos_embed" not in dec  # fixed
    assert not any(k.startswith(("blocks", "patch_embed", "cls_token", "norm")) for k in dec)
    assert set(EXCLUDE_PRESETS) == {"none", "decoder", "patch-embed", "decoder-embed", "cls-token"}
    with pytest.raises(ConfigError, match="fedmae.exclude"):
        excluded_keys(model, "class-token")


# -- end to end --------------------------------------------------------------------------------------
def test_fedmae_pretrain_then_federated_finetune_end_to_end(in_process, tmp_path):
    run_dir = sim.simulate(
        {
            **MICRO,
            "method": "fedmae",
            "num-server-rounds": 2,
            "local-epochs": 1,
            "mim.lr": 1.5e-3,  # pre-training (AdamW: the mim.optimizer default)
            "batch-size": 16,
            "synthetic-per-class": 16,
            "finetune-rounds": 2,
            "finetune-epochs": 1,
            "finetune-lr": 1e-3,
            "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "c"),
            "run-name": "r",
        },
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    pre = [r for r in summary["rounds"] if r["split"] == "pretrain"]
    assert [r["round"] for r in pre] == [1, 2] and all(r["metrics"]["loss"] > 0 for r in pre)
    for key in ("balanced_accuracy", "precision", "f1", "specificity", "auc", "accuracy"):
        assert key in summary["final"] and set(summary["final"]["per_client"]) == {"0", "1"}
    pretrained = torch.load(run_dir / "model-pretrained.pt")
    assert set(pretrained) == set(micro_mae().state_dict())
    final = torch.load(run_dir / "model.pt")
    assert final["head.weight"].shape == (5, 64)
    # FedMAE's default representation (000 §IV-A): the class token's output under the encoder's final
    # norm (timm's token pooling), not the patch mean under a fresh fc_norm
    assert "backbone.norm.weight" in final and "backbone.fc_norm.weight" not in final
    assert json.loads((run_dir / "config.json").read_text())["vit-pool"] == "token"
    cfg = registry.load_config({**MICRO, "method": "fedmae"})
    # the fine-tuning started from the pre-trained encoder: round-0 classifier = mapped encoder
    start = mae_backbone_state(cfg, 5)(pretrained)
    assert set(start) == {k[len("backbone.") :] for k in final if k.startswith("backbone.")}
    # the class token (the default fedmae.exclude) stayed on the clients (000 §IV-D): the copies in
    # their state stores drifted apart, and the pre-trained model the fine-tuning starts from holds
    # their mean weighted by training images, not either client's copy nor the initial value
    n = {pid: c["num-examples"] for pid, c in pre[-1]["per_client"].items()}
    own = {}
    for pid in n:
        store = StateStore(run_dir / "client-state" / f"client-{pid}")
        own[pid] = store.open(max(store.steps())).tensors(mae_client.KEPT)
    assert set(own["0"]) == {"cls_token"} == set(own["1"])
    assert not torch.allclose(own["0"]["cls_token"], own["1"]["cls_token"], atol=1e-6)
    expected = sum(n[pid] * own[pid]["cls_token"] for pid in n) / sum(n.values())
    assert torch.allclose(pretrained["cls_token"], expected, atol=1e-6)
    assert torch.equal(start["cls_token"], pretrained["cls_token"])


# -- the settings pre-registered sweeps and presets ran with -------------------------------------------
#: FedMAE's decoder and every ViT's pooling before the decoder was sized to its encoder and FedMAE
#: fine-tuned on the class token by default
FORMER_DEFAULTS = {
    "fedmae.decoder-embed-dim": 512,
    "fedmae.decoder-depth": 8,
    "fedmae.decoder-num-heads": 16,
    "vit-pool": "avg",
}
SWEEPS = sorted((ROOT / "sweeps").rglob("*.toml"))


def decoder_and_pool(cfg) -> tuple:
    return (*(cfg.option(k) for k in FORMER_DEFAULTS if k.startswith("fedmae.")), cfg.vit_pool)


@pytest.mark.parametrize("path", SWEEPS, ids=[str(p.relative_to(ROOT / "sweeps")) for p in SWEEPS])
def test_registered_sweeps_run_fedmae_with_the_decoder_and_pooling_they_were_registered_with(path):
    """Every FedMAE run of every sweep (full and --quick) resolves to the decoder and ViT pooling it
    had under the former defaults: a sweep's table stays the experiment it was registered as."""
    valid = sorted([*default_config(), *registry.method_options()])
    runs = 0
    for quick in (False, True):
        sweep = fs.load_sweep(path, quick=quick, load_config=registry.load_config, valid_keys=valid)
        for run in sweep.runs():
            cfg = registry.load_config(run.overrides)
            if cfg.method == "fedmae":
                former = registry.load_config({**FORMER_DEFAULTS, **run.overrides})
                assert decoder_and_pool(cfg) == decoder_and_pool(former), (quick, run.name)
                runs += 1
    assert runs or '"fedmae"' not in path.read_text()


@pytest.mark.parametrize("name", ["fedmae-paper", "fed-mae-paper", "fedmae-small", "fed-mae-small"])
def test_presets_pin_their_decoder_and_fine_tune_on_their_papers_representation(name):
    """The paper presets pin the papers' ViT-B decoder (512 × 8 × 16); 000's FedMAE presets classify the
    class token's output (000 §IV-A), 003's Fed-MAE presets the mean of the patch tokens (003 §III-D)."""
    preset = tomllib.loads((ROOT / "presets" / f"{name}.toml").read_text())
    cfg = registry.load_config(preset)
    assert (
        decoder_and_pool(cfg)[:3] == decoder_and_pool(registry.load_config({**FORMER_DEFAULTS, **preset}))[:3]
    )
    if name.endswith("-paper"):
        assert decoder_and_pool(cfg)[:3] == (512, 8, 16)
    assert cfg.vit_pool == ("token" if name.startswith("fedmae") else "avg")


# -- the representation fine-tuning classifies ---------------------------------------------------------
def test_fedmae_classifies_the_class_token_by_default_and_the_other_vit_methods_the_patch_mean():
    """000 §IV-A: the class token's output is the image's representation (FedMAE's default); 003 §III-D
    and MAE fine-tune on average pooling (Fed-BEiT's, and every other method's).  A value set wins,
    and config.json (``to_flat``) records the resolved one."""
    vit = {"model": "vit-micro", "image-size": 32}
    assert registry.load_config({**vit, "method": "fedmae"}).vit_pool == "token"
    assert registry.load_config({**vit, "method": "fedmae"}).to_flat()["vit-pool"] == "token"
    assert registry.load_config({**vit, "method": "fedmae", "vit-pool": "avg"}).vit_pool == "avg"
    for method in ("fedbeit", "random-init", "fedavg", "fedprox", "fedmocov3"):
        assert registry.load_config({**vit, "method": method}).vit_pool == "avg", method
    assert registry.load_config({"method": "fedclf", "model": "tiny-cnn"}).vit_pool == "avg"
    with pytest.raises(ConfigError, match="'vit-pool' must be one of"):
        registry.load_config({**vit, "method": "fedmae", "vit-pool": "cls"})


@pytest.mark.parametrize(
    "defaults, match",
    [
        ({"vit-pool": "cls"}, r"defaults\['vit-pool'\] = 'cls' is none of \['avg', 'token'\]"),
        (
            {"fedmae.mask-ratio": 0.5},
            r"'fedmae.mask-ratio', which is neither one of its options nor a core key",
        ),
    ],
)
def test_a_method_cannot_register_defaults_for_keys_it_cannot_set(defaults, match):
    """A default for a key the method does not declare (another method's option) or a core key's value
    the key does not take would be applied silently to every run of the method: refused at registration."""
    toy = registry.Method("toy-defaults", "strategies.fedavg", "clients.fedavg", "a toy", defaults=defaults)
    with pytest.raises(ValueError, match=match):
        registry.register_method(toy)
    assert "toy-defaults" not in registry.METHODS
