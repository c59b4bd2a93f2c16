"""Issue 15 item 8: MAE pre-training must not destroy what fine-tuning learns, on real images
(scikit-learn's bundled digits, 8×8 upscaled to 32 px; one client's share; vit-micro)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import registry
from fedderm.mae import build_mae, vit_backbone_state
from fedderm.models import create_model
from fedderm.train import evaluate, mim_schedule, random_flips, to_input, train_epochs, train_supervised

MICRO = {
    "method": "fedmae",
    "model": "vit-micro",
    "image-size": 32,
    "fedmae.decoder-embed-dim": 32,
    "fedmae.decoder-depth": 1,
    "fedmae.decoder-num-heads": 2,
}


def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    x = np.kron((d.images / 16.0 * 255).round().astype(np.uint8), np.ones((4, 4), dtype=np.uint8))
    x = torch.from_numpy(np.repeat(x[:, None], 3, axis=1))  # N×3×32×32 uint8
    y = torch.from_numpy(d.target.astype(np.int64))
    idx = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    train, test = idx[: int(0.7 * len(y))][: int(0.7 * len(y)) // 4], idx[int(0.8 * len(y)) :]
    return x[train], y[train], x[test], y[test]


def _pretrain(cfg, images, labels, recipe: bool):
    """3 rounds × 2 local epochs of MAE pre-training: fedderm's default schedule (Adam 1e-3, cosine per
    round) or the MAE recipe that 000 §V-B follows (AdamW, base rate 1.5e-4 × batch/256, wd 0.05,
    β2 0.95, warm-up, cosine per iteration: ``mim.*`` keys of sweeps/000-fedmae-*.toml)."""
    torch.manual_seed(0)
    mae = build_mae(cfg)
    rounds, epochs = 3, 2
    for r in range(1, rounds + 1):
        if recipe:
            kw = dict(
                optimizer="adamw",
                weight_decay=0.05,
                **mim_schedule(
                    1.5e-4,
                    server_round=r,
                    num_rounds=rounds,
                    local_epochs=epochs,
                    batch_size=32,
                    lr_step="iteration",
                    warmup_epochs=1,
                    adam_beta2=0.95,
                    lr_scaling="batch",
                ),
            )
        else:
            kw = dict(
                optimizer="adam",
                weight_decay=5e-4,
                **mim_schedule(1e-3, server_round=r, num_rounds=rounds, local_epochs=epochs, batch_size=32),
            )
        train_epochs(
            mae,
            images,
            labels,
            lambda m, xb, yb, g: m(to_input(random_flips(xb, g), "cpu"), 0.75, g)[0],
            epochs=epochs,
            batch_size=32,
            seed=r,
            **kw,
        )
    return mae


def _finetune(mae, images, labels, test_x, test_y) -> float:
    torch.manual_seed(0)
    clf = create_model("vit-micro", 10, 32)
    if mae is not None:
        clf.backbone.load_state_dict(
            vit_backbone_state(mae.state_dict(), clf.backbone.state_dict().keys()), strict=True
        )
    train_supervised(
        clf, images, labels, epochs=30, batch_size=32, lr=1e-4, optimizer="adam", weight_decay=5e-4, seed=0
    )
    return evaluate(clf, test_x, test_y, 10)["balanced_accuracy"]


def test_mae_recipe_pretraining_fine_tunes_better_than_random_init_on_digits():
    torch.set_num_threads(1)
    x, y, tx, ty = _digits()
    cfg = registry.load_config(MICRO)
    labelled = len(y) // 2
    random_init = _finetune(None, x[:labelled], y[:labelled], tx, ty)
    former = _finetune(_pretrain(cfg, x, y, recipe=False), x[:labelled], y[:labelled], tx, ty)
    recipe = _finetune(_pretrain(cfg, x, y, recipe=True), x[:labelled], y[:labelled], tx, ty)
    # measured (1 thread): random init 0.164, default schedule 0.174, MAE recipe 0.312 (chance 0.10)
    print(f"random init {random_init:.3f}, default schedule {former:.3f}, MAE recipe {recipe:.3f}")
    assert recipe > random_init + 0.08 and recipe > former + 0.08, (random_init, former, recipe)
    assert F.one_hot(ty, 10).sum(0).min() > 20  # every class is in the test set
