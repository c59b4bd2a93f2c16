"""Encoder probes during pre-training (``probe-every``)."""

import csv
import json

import numpy as np
import pytest
import torch

import registry
import sim
from fedderm.config import ConfigError
from fedderm.metrics import METRIC_NAMES
from fedderm.models import create_classifier, create_model
from fedderm.probes import KNN_K, knn_probe, linear_probe

SSL_METHODS = {
    "fedclf",
    "fedmoco",
    "fedsimclr",
    "localcl",
    "fedrotation",
    "fedmae",
    "fedbeit",
    "ssl-flbt",
    "fedbyol",
    "fedema",
    "fedmocov3",
}


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    return train_test_split(x / 16.0, y, test_size=0.3, random_state=0, stratify=y)


def test_knn_of_random_features_is_chance_and_of_trained_features_high(digits):
    """A random encoder (features independent of the image) scores chance (1/10), the hidden layer
    of a classifier trained on the same training images far above it."""
    from sklearn.neural_network import MLPClassifier

    x_train, x_val, y_train, y_val = digits
    rng = np.random.default_rng(0)
    random_train, random_val = rng.normal(size=(len(x_train), 32)), rng.normal(size=(len(x_val), 32))
    chance = knn_probe(random_train, y_train, random_val, y_val, 10)
    assert abs(chance["balanced_accuracy"] - 0.1) < 0.05
    assert abs(linear_probe(random_train, y_train, random_val, y_val, 10)["balanced_accuracy"] - 0.1) < 0.05

    mlp = MLPClassifier(hidden_layer_sizes=(32,), max_iter=300, random_state=0).fit(x_train, y_train)

    def hidden(x):
        return np.maximum(x @ mlp.coefs_[0] + mlp.intercepts_[0], 0)

    trained = knn_probe(hidden(x_train), y_train, hidden(x_val), y_val, 10)
    assert trained["balanced_accuracy"] > 0.85
    assert linear_probe(hidden(x_train), y_train, hidden(x_val), y_val, 10)["balanced_accuracy"] > 0.85
    assert set(trained) == set(METRIC_NAMES)


def test_knn_uses_k_20_cosine_neighbours():
    """Cosine: scaling a feature vector changes nothing; k = 20 votes give probabilities in 1/20 steps."""
    rng = np.random.default_rng(1)
    train, labels = rng.normal(size=(60, 5)), rng.integers(0, 3, 60)
    val, val_y = rng.normal(size=(30, 5)), rng.integers(0, 3, 30)
    a = knn_probe(train, labels, val, val_y, 3)
    b = knn_probe(train * rng.uniform(0.1, 10, size=(60, 1)), labels, val * 7.0, val_y, 3)
    assert a == b
    assert KNN_K == 20
    few = knn_probe(train[:5], labels[:5], val, val_y, 3)  # fewer images than k: k = 5
    assert 0 <= few["accuracy"] <= 1


def test_every_ssl_method_and_only_those_has_a_probe():
    assert {name for name, m in registry.METHODS.items() if m.probe} == SSL_METHODS


def _initial_state(method: str, cfg) -> dict:
    from fedderm.beit import build_beit
    from fedderm.mae import build_mae
    from fedderm.rotation import NUM_ROTATIONS
    from fedderm.simclr import build_simclr
    from fedderm.ssl_pseudo import MultiTaskSSLNet, encoder_state, original_ssl_network
    from strategies.fedclf import initial_moco

    if method in ("fedclf", "fedmoco", "localcl"):
        return initial_moco(cfg).to_torch_state_dict()
    if method == "fedsimclr":
        return build_simclr(cfg.model, cfg.image_size).state_dict()
    if method in ("fedbyol", "fedema"):
        from strategies.fedbyol import initial_online

        return initial_online(cfg)
    if method == "fedmocov3":
        from strategies.fedmocov3 import initial_model

        return initial_model(cfg)
    if method == "fedrotation":
        return create_model(cfg.model, NUM_ROTATIONS, cfg.image_size).state_dict()
    if method == "fedmae":
        return build_mae(cfg).state_dict()
    if method == "fedbeit":
        return build_beit(cfg).state_dict()
    if cfg.option("ssl.pretrain") == "pseudo":
        return encoder_state(MultiTaskSSLNet(cfg.model, 2, cfg.image_size, "both").state_dict())
    return original_ssl_network(cfg.model, cfg.image_size, str(cfg.option("ssl.tasks"))).state_dict()


@pytest.mark.parametrize(
    "method,extra",
    [
        *((m, {}) for m in sorted(SSL_METHODS - {"ssl-flbt"})),
        ("ssl-flbt", {}),
        ("ssl-flbt", {"ssl.pretrain": "federated", "ssl.tasks": "restoration"}),
        ("ssl-flbt", {"ssl.pretrain": "local", "ssl.tasks": "simclr"}),
    ],
)
def test_probe_mapping_gives_the_whole_backbone(method, extra):
    """Each SSL method's ``Method.probe`` maps its pre-training model onto every key of
    ``cfg.model``'s backbone (strict load), with the pre-trained values."""
    from clients.probe import mapping

    cfg = registry.load_config(registry.smallest_run(method, **{"probe-every": 1}, **extra))
    torch.manual_seed(3)
    state = _initial_state(method, cfg)
    backbone = mapping(method)(cfg, state)
    model = create_classifier(cfg, 4)  # the run's classifier (FedMAE's: class-token pooling)
    model.backbone.load_state_dict(backbone, strict=True)
    # the backbone's tensors are the pre-trained ones (same suffix, same values); MAE/BEiT's fresh
    # fc_norm (average pooling) is the only exception
    pretrained = [
        k
        for k in backbone
        if any((s == k or s.endswith("." + k)) and torch.equal(state[s], backbone[k]) for s in state)
    ]
    assert len(backbone) > 0 and set(backbone) - set(pretrained) <= {"fc_norm.weight", "fc_norm.bias"}


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"method": "fedavg", "probe-every": 2}, "'probe-every'.*'fedavg'"),
        ({"method": "random-init", "probe-every": 1}, "'probe-every'.*'random-init'"),
        ({"method": "fedclf", "probe-every": -1}, "'probe-every' must be >= 0"),
    ],
)
def test_bad_probe_every(raw, match):
    with pytest.raises(ConfigError, match=match):
        registry.load_config(raw)


def test_fedclf_run_records_probes_every_round(in_process, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = sim.simulate(
        registry.smallest_run(
            "fedclf",
            **{
                "num-server-rounds": 2,
                "probe-every": 1,
                "fedclf.queue-size": 16,
                "finetune": "none",
                "output-dir": str(tmp_path),
                "cache-dir": str(tmp_path / "cache"),
                "run-name": "p",
            },
        ),
        num_supernodes=2,
    )
    with open(run_dir / "rounds.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"].startswith("probe-")]
    got = {(r["split"], r["round"], r["client"]) for r in rows}
    assert got == {
        (f"probe-{k}", str(r), c) for k in ("knn", "linear") for r in (1, 2) for c in ("0", "1", "mean")
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    for r in rows:
        assert 0 <= float(r["balanced_accuracy"]) <= 1
        if r["client"] != "mean":  # scored on the client's validation split
            assert int(r["num-examples"]) == sum(summary["classes"]["counts"][r["client"]]["val"].values())
    probes = [(e["split"], e["round"]) for e in summary["rounds"] if e["split"].startswith("probe")]
    assert probes == [("probe-knn", 1), ("probe-linear", 1), ("probe-knn", 2), ("probe-linear", 2)]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert {"probe-knn/balanced_accuracy/mean", "probe-linear/balanced_accuracy/client-1"} <= set(
        acc.Tags()["scalars"]
    )
