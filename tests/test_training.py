import math

import numpy as np
import pytest
import torch

from fedderm.data.synthetic import CLASSES, generate, load_synthetic
from fedderm.models import create_model, list_models
from fedderm.train import proximal_term, round_lr, train_supervised


def test_synthetic_is_deterministic_cached_and_sites_differ(tmp_path):
    a = load_synthetic(3, 4, 32, seed=7, cache_dir=tmp_path)
    b = load_synthetic(3, 4, 32, seed=7, cache_dir=tmp_path)  # from the cache
    c = generate(3, 4, 32, seed=8)
    assert a.images.shape == (3 * len(CLASSES) * 4, 3, 32, 32) and a.images.dtype == torch.uint8
    assert torch.equal(a.images, b.images) and not torch.equal(a.images, c.images)
    assert len(list(tmp_path.glob("synthetic-*.pt"))) == 1
    assert np.array_equal(np.bincount(a.labels), [12] * len(CLASSES))
    # each site has its own skin tone: mean corner brightness differs between sites
    corner = a.images[:, :, :4, :4].float().mean(dim=(1, 2, 3)).numpy()
    means = [corner[a.sites == s].mean() for s in range(3)]
    assert means[0] - means[2] > 20


@pytest.mark.parametrize("name", ["tiny-cnn", "resnet18", "vit-tiny"])
def test_models_shapes(name):
    model = create_model(name, num_classes=7, image_size=32)
    x = torch.randn(2, 3, 32, 32)
    assert model(x).shape == (2, 7)
    assert model.forward_features(x).shape == (2, model.num_features)
    assert set(list_models()) >= {"resnet18", "resnet50", "tiny-cnn", "vit-tiny"}
    with pytest.raises(ValueError, match="unknown model 'resnet19'"):
        create_model("resnet19", 2)


def test_round_lr_cosine():
    assert round_lr(0.1, 1, 10) == pytest.approx(0.1)
    assert round_lr(0.1, 6, 10) == pytest.approx(0.05)
    assert round_lr(0.1, 5, 10, "constant") == 0.1


def test_proximal_term_equals_squared_distance():
    model = torch.nn.Linear(3, 2)
    ref = [torch.zeros_like(p) for p in model.parameters()]
    expected = sum((p.detach() ** 2).sum() for p in model.parameters())
    assert proximal_term(model, ref).item() == pytest.approx(expected.item())


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 255, (n, 3, 16, 16), generator=g, dtype=torch.uint8), torch.arange(n) % 3


def test_fedprox_keeps_weights_closer_to_global():
    images, labels = _data()
    start = create_model("tiny-cnn", 3)
    drift = {}
    for mu in (0.0, 10.0):
        model = create_model("tiny-cnn", 3)
        model.load_state_dict(start.state_dict())
        train_supervised(
            model, images, labels, epochs=3, batch_size=16, lr=0.05, optimizer="sgd", proximal_mu=mu, seed=0
        )
        drift[mu] = sum(((p - q) ** 2).sum().item() for p, q in zip(model.parameters(), start.parameters()))
    assert drift[10.0] < 0.7 * drift[0.0]


def test_training_is_deterministic_and_reduces_loss():
    images, labels = _data()
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = create_model("tiny-cnn", 3)
        first = train_supervised(model, images, labels, epochs=1, batch_size=16, lr=0.01, seed=3)
        last = train_supervised(model, images, labels, epochs=5, batch_size=16, lr=0.01, seed=4)
        runs.append((first["train_loss"], last["train_loss"], model.state_dict()))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(torch.equal(runs[0][2][k], runs[1][2][k]) for k in runs[0][2])
    assert runs[0][1] < runs[0][0]


def test_finetuning_takes_its_own_batch_size():
    """003 §IV-B3 pre-trains with one batch and fine-tunes with 256: finetune-batch-size (0 = batch-size)."""
    import registry
    from clients.common import ClientSession
    from fedderm.config import ConfigError
    from fedderm.node import NodeSettings

    def session(**raw):
        cfg = registry.load_config({"batch-size": 128, **raw})
        return ClientSession(cfg, data=None, device=torch.device("cpu"), partition_id=0, node=NodeSettings(0))

    s = session(**{"finetune-batch-size": 256})
    assert s.local_kwargs(1)["batch_size"] == 128 and s.local_kwargs(1, finetune=True)["batch_size"] == 256
    assert session().local_kwargs(1, finetune=True)["batch_size"] == 128
    with pytest.raises(ConfigError, match="finetune-batch-size"):
        registry.load_config({"finetune-batch-size": -1})


def test_every_stage_takes_its_lr_from_the_run_schedule():
    """lr-schedule/lr-decay reach the spine's rounds, the fine-tuning stage and the holdout epochs alike."""
    import registry
    from clients.common import ClientSession
    from fedderm.node import NodeSettings

    cfg = registry.load_config(
        {
            "lr-schedule": "exponential",
            "lr-decay": 0.5,
            "lr": 0.1,
            "finetune-lr": 0.01,
            "finetune-epochs": 3,
            "finetune-optimizer": "sgd",
            "local-epochs": 2,
        }
    )
    s = ClientSession(cfg, data=None, device=torch.device("cpu"), partition_id=1, node=NodeSettings(1))
    spine, tune = s.local_kwargs(3), s.local_kwargs(3, finetune=True)
    assert (
        spine["lr"] == pytest.approx(0.1 * 0.5**2) and spine["epochs"] == 2 and spine["optimizer"] == "adam"
    )
    assert tune["lr"] == pytest.approx(0.01 * 0.5**2) and tune["epochs"] == 3 and tune["optimizer"] == "sgd"
    assert tune["seed"] != spine["seed"]  # the fine-tuning stage draws its own batches
    assert s.lr_at(1e-3, 4, 10) == pytest.approx(1e-3 * 0.5**3)
    cosine = ClientSession(
        registry.load_config({"finetune-rounds": 4}), None, torch.device("cpu"), 0, NodeSettings(0)
    )
    assert cosine.local_kwargs(3, finetune=True)["lr"] == pytest.approx(
        1e-4 * 0.5 * (1 + math.cos(math.pi * 2 / 4))
    )
    assert cosine.local_kwargs(2, 2, finetune=True)["lr"] == pytest.approx(
        0.5e-4
    )  # the stage's own round count
