"""BatchNorm running statistics of the local loops (run-config ``bn-stats``, fedderm.train.RoundStats):
the equation, every loop that trains a BatchNorm model, and the few-steps-per-round federation
that collapsed to one class with PyTorch's exponential average."""

import json
import logging

import numpy as np
import pytest
import torch

from fedderm.flbt import build_projected_net, train_with_model_term
from fedderm.models import create_model
from fedderm.ssl_pseudo import MultiTaskSSLNet, train_multitask
from fedderm.train import batchnorm_layers, train_supervised, use_bn_stats

N, BATCH, EPOCHS = 40, 16, 2  # batches of 16, 16, 8: three per epoch
PER_EPOCH = 3


def _data(seed=0, size=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (N, 3, size, size), dtype=torch.uint8, generator=g), torch.randint(
        0, 3, (N,), generator=g
    )


def _tiny(seed=0):
    torch.manual_seed(seed)
    return create_model("tiny-cnn", num_classes=3, image_size=16)


KW = dict(epochs=EPOCHS, batch_size=BATCH, lr=0.01, optimizer="sgd", seed=3)


def test_round_stats_are_the_cumulative_average_of_the_last_epochs_batch_statistics():
    x, y = _data()
    model = _tiny()
    first = batchnorm_layers(model)[0]
    seen = []  # (mean, unbiased var) per channel of every training batch at the first BatchNorm's input
    hook = first.register_forward_pre_hook(
        lambda m, inp: (
            seen.append((inp[0].mean((0, 2, 3)), inp[0].var((0, 2, 3), unbiased=True)))
            if m.training
            else None
        )
    )
    train_supervised(model, x, y, bn_stats="round", **KW)
    hook.remove()
    assert len(seen) == EPOCHS * PER_EPOCH
    last = seen[-PER_EPOCH:]
    torch.testing.assert_close(first.running_mean, torch.stack([m for m, _ in last]).mean(0))
    torch.testing.assert_close(first.running_var, torch.stack([v for _, v in last]).mean(0))
    assert int(first.num_batches_tracked) == PER_EPOCH
    assert all(m.momentum == 0.1 for m in batchnorm_layers(model))  # each layer's momentum is back


def test_round_and_ema_train_the_same_weights_and_differ_only_in_the_statistics():
    x, y = _data()
    a, b = _tiny(), _tiny()
    ra = train_supervised(a, x, y, bn_stats="round", **KW)
    rb = train_supervised(b, x, y, bn_stats="ema", **KW)
    assert ra == rb  # train mode normalises with batch statistics in both
    sa, sb = a.state_dict(), b.state_dict()
    stats = {k for k in sa if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    assert stats and all(torch.equal(sa[k], sb[k]) for k in sa if k not in stats)
    var = sorted(k for k in stats if k.endswith("running_var"))[0]
    assert not torch.allclose(sa[var], sb[var])
    assert int(sb[var.replace("running_var", "num_batches_tracked")]) == EPOCHS * PER_EPOCH  # PyTorch's EMA


@pytest.mark.parametrize("loop", ["train_epochs", "flbt", "ssl-pseudo"])
@pytest.mark.parametrize("mode", ["round", "ema"])
def test_every_local_loop_keeps_the_runs_bn_stats(loop, mode):
    """The shared loop (every supervised, SSL and fine-tuning stage), FL-BT/MOON's loop and the
    pseudo-image pre-training loop read ``bn-stats`` from the ClientApp's context."""
    x, y = _data()
    torch.manual_seed(0)
    with use_bn_stats(mode):
        if loop == "train_epochs":
            model = _tiny()
            train_supervised(model, x, y, **KW)
        elif loop == "flbt":
            model = build_projected_net("tiny-cnn", 3, 16, proj_dim=8)
            train_with_model_term(model, x, y, term=None, **KW)
        else:
            model = MultiTaskSSLNet("tiny-cnn", 2, 16, "both", width=8)
            train_multitask(model, x, y % 2, epochs=EPOCHS, batch_size=BATCH, lr=1e-3, seed=3)
    layers = batchnorm_layers(model)
    assert layers and all(m.momentum == 0.1 for m in layers)
    expected = PER_EPOCH if mode == "round" else EPOCHS * PER_EPOCH
    assert {int(m.num_batches_tracked) for m in layers} == {expected}


def test_a_last_epoch_without_a_usable_batch_keeps_the_statistics():
    x, y = _data()
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    train_supervised(model, x[:1], y[:1], bn_stats="round", **KW)  # one image: every batch is skipped
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_bn_stats_names_the_key_when_wrong():
    with pytest.raises(ValueError, match="bn-stats"):
        with use_bn_stats("precise"):
            pass


# ---------------------------------------------------------------- the federation of the report
@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    """scikit-learn's digits 0-4 as an image folder (60 per class): 2 IID clients get ~90 training
    images each, 3 steps per round with batch 32."""
    pytest.importorskip("sklearn")
    from PIL import Image

    from fedderm.data.digits import digits_arrays

    root = tmp_path_factory.mktemp("digits") / "data"
    images, labels = digits_arrays(8)
    rng = np.random.default_rng(0)
    for c in range(5):
        (root / f"c{c}").mkdir(parents=True)
        for i in rng.permutation(np.flatnonzero(labels == c))[:60]:
            Image.fromarray(images[i]).convert("RGB").save(root / f"c{c}" / f"{i}.png")
    return root


def _run(root, tmp_path, **overrides):
    from bench.loop_grid import run_app

    run_dir = run_app(
        {
            "dataset": "folder",
            "data-path": str(root),
            "cache-dir": str(tmp_path / "cache"),
            "output-dir": str(tmp_path / "runs"),
            "partition": "iid",
            "model": "tiny-cnn",
            "image-size": 16,
            "num-server-rounds": 5,
            "local-epochs": 1,
            "tensorboard": False,
            **overrides,
        }
    )
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_few_steps_per_round_learn_the_digits_and_the_saved_model_predicts_every_class(
    digits_folder, tmp_path
):
    """The report's run (Adam 1e-3, batch 32, <= 100 training images per client, 3 steps per round):
    with PyTorch's EMA statistics the evaluated model predicted one class."""
    import registry
    from fedderm.data import load_client_data
    from fedderm.inference import load_model
    from server_app import saved_run_config

    run_dir, summary = _run(digits_folder, tmp_path)
    counts = summary["classes"]["counts"]
    assert all(sum(c["train"].values()) <= 100 for c in counts.values())
    assert summary["final"]["balanced_accuracy"] >= 0.85
    assert summary["warnings"] == []  # a healthy run carries none
    clf = load_model(run_dir / "model.pt")
    cfg = registry.load_config(saved_run_config(run_dir))
    for pid in (0, 1):
        images, labels = load_client_data(cfg, pid, 2).tensors("train")
        predicted = [clf.classes.index(name) for name, _ in clf.predict(images)]
        assert sorted(set(predicted)) == [0, 1, 2, 3, 4]
        assert np.mean(np.asarray(predicted) == labels.numpy()) >= 0.85


def test_a_collapsed_run_names_the_class_in_the_console_and_in_summary(digits_folder, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_dir, summary = _run(digits_folder, tmp_path, optimizer="sgd", lr=10.0, **{"num-server-rounds": 3})
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("health:")]
    assert len(warned) >= 1 and summary["warnings"] == warned
    assert any(f"class '{name}'" in warned[0] for name in summary["classes"]["names"])
    assert "[!]" in (run_dir / "final_table.txt").read_text()
