"""Fed-BEiT (003 §III-C): block-wise masking, the tokenizers, the loss, end to end."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import registry
import sim
from fedderm.beit import (
    RandomProjectionTokenizer,
    block_mask,
    build_beit,
    build_tokenizer,
    masked_token_loss,
    num_masking_patches,
)
from fedderm.config import ConfigError
from fedderm.mae import patchify
from fedderm.models import create_model
from strategies.fedmae import mae_backbone_state

MICRO = {"method": "fedbeit", "model": "vit-micro", "image-size": 32, "fedbeit.vocab-size": 64}


def test_block_mask_is_made_of_blocks_and_hits_the_target():
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(50):
        mask = block_mask(14, 14, 75, rng)  # BEiT's 224 px setting: 40 % of 196 patches
        sizes.append(int(mask.sum()))
        assert mask.sum() <= 75
    assert np.mean(sizes) > 70  # nearly always reaches the target
    # blocks, not scattered patches: most masked patches have a masked 4-neighbour
    m = block_mask(14, 14, 75, np.random.default_rng(1))
    neighbours = sum(
        1
        for i, j in zip(*np.nonzero(m))
        if any(
            0 <= i + di < 14 and 0 <= j + dj < 14 and m[i + di, j + dj]
            for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1))
        )
    )
    assert neighbours / m.sum() > 0.9
    small = block_mask(4, 4, num_masking_patches(4, 0.4), np.random.default_rng(2))
    assert 1 <= small.sum() <= 6  # a 4x4 grid (32 px, patch 8) can be masked too
    assert np.array_equal(
        block_mask(14, 14, 75, np.random.default_rng(3)), block_mask(14, 14, 75, np.random.default_rng(3))
    )


def test_masked_token_loss_is_eq3():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (2, 6), generator=g)
    masked = torch.tensor([[1, 0, 0, 1, 0, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    logits = torch.randn(int(masked.sum()), 10, generator=g)
    targets = tokens[masked].tolist()
    expected = -sum(math.log(torch.softmax(logits[i], 0)[t].item()) for i, t in enumerate(targets)) / len(
        targets
    )
    assert masked_token_loss(logits, tokens, masked).item() == pytest.approx(expected, rel=1e-5)


def test_random_projection_tokenizer_is_the_nearest_codeword_and_shared_by_seed():
    tok = RandomProjectionTokenizer(patch_size=8, vocab_size=32, seed=5)
    imgs = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    ids = tok(imgs)
    assert ids.shape == (3, 4) and ids.dtype == torch.long
    codes = torch.nn.functional.normalize(patchify(imgs, 8) @ tok.projection, dim=-1)
    dist = torch.cdist(codes.reshape(-1, codes.shape[-1]), tok.codebook)
    assert torch.equal(ids.reshape(-1), dist.argmin(dim=1))
    assert torch.equal(RandomProjectionTokenizer(8, 32, seed=5)(imgs), ids)  # every client: same tokens
    assert not torch.equal(RandomProjectionTokenizer(8, 32, seed=6)(imgs), ids)
    cfg = registry.load_config(MICRO)
    assert torch.equal(build_tokenizer(cfg).codebook, build_tokenizer(cfg).codebook)


class _GridTokenizer(nn.Module):
    """A toy tokenizer: the brightest channel of each 8x8 patch (ids 0..2)."""

    def forward(self, x):
        return nn.functional.avg_pool2d(x, 8).argmax(dim=1)


def test_user_supplied_torchscript_tokenizer(tmp_path):
    path = tmp_path / "tok.pt"
    torch.jit.trace(_GridTokenizer(), torch.rand(1, 3, 32, 32)).save(str(path))
    cfg = registry.load_config({**MICRO, "fedbeit.tokenizer": str(path)})
    tok = build_tokenizer(cfg)
    imgs = torch.zeros(1, 3, 32, 32) - 1
    imgs[0, 2, :8, :8] = 1  # patch 0 is blue
    ids = tok(imgs)
    assert ids.shape == (1, 16) and ids[0, 0] == 2
    small = registry.load_config({**MICRO, "fedbeit.tokenizer": str(path), "fedbeit.vocab-size": 2})
    with pytest.raises(ValueError, match="outside"):
        build_tokenizer(small)(imgs)
    with pytest.raises(ConfigError, match="fedbeit.tokenizer"):
        build_tokenizer(registry.load_config({**MICRO, "fedbeit.tokenizer": str(tmp_path / "none.pt")}))


def test_beit_encoder_transfers_to_the_classifier():
    cfg = registry.load_config(MICRO)
    beit = build_beit(cfg)
    assert {k.split(".")[0] for k in beit.state_dict()} == {
        "patch_embed",
        "cls_token",
        "mask_token",
        "pos_embed",
        "blocks",
        "norm",
        "lm_head",
    }
    clf = create_model("vit-micro", 5, 32)
    clf.backbone.load_state_dict(mae_backbone_state(cfg, 5)(beit.state_dict()), strict=True)
    assert torch.equal(clf.backbone.pos_embed, beit.pos_embed)
    # with nothing masked, the BEiT encoder is the classifier's ViT
    x = torch.randn(2, 3, 32, 32)
    beit.eval(), clf.eval()
    with torch.no_grad():
        ours = beit.forward_features(x, torch.zeros(2, 16, dtype=torch.bool))
        theirs = beit.norm(clf.backbone.forward_features(x))
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_fedbeit_end_to_end(in_process, tmp_path):
    run_dir = sim.simulate(
        {
            **MICRO,
            "num-server-rounds": 2,
            "local-epochs": 1,
            "mim.lr": 1.5e-3,  # pre-training (AdamW: the mim.optimizer default)
            "batch-size": 16,
            "synthetic-per-class": 16,
            "finetune-rounds": 1,
            "finetune-epochs": 1,
            "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "c"),
            "run-name": "r",
        },
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    pre = [r for r in summary["rounds"] if r["split"] == "pretrain"]
    assert [r["round"] for r in pre] == [1, 2]
    assert all(0 < r["metrics"]["loss"] < 2 * math.log(64) for r in pre)  # cross-entropy over 64 tokens
    assert set(summary["final"]["per_client"]) == {"0", "1"} and "balanced_accuracy" in summary["final"]
    assert torch.load(run_dir / "model-pretrained.pt")["lm_head.weight"].shape == (64, 64)
