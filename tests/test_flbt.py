"""FL-BT, MOON and FedBN (paper 004): losses by hand, local training, key selection."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedderm.flbt import (
    batchnorm_keys,
    build_projected_net,
    frozen_copy,
    train_flbt,
    train_moon,
    train_with_model_term,
)
from fedderm.losses import barlow_twins, cross_correlation, moon_contrastive, moon_from_cosines
from fedderm.models import create_model
from fedderm.train import train_supervised

LAMBDA = 0.005


# ----------------------------------------------------------------------------- Barlow Twins
def test_barlow_twins_paper_normalisation_by_hand():
    z_a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    z_b = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    # Eq. 6: column norms |a0| = √10, |a1| = √20, |b0| = √5, |b1| = 1;
    # Σ_b a_bi b_bj: (0,0) 1·2+3·1 = 5, (0,1) 3, (1,0) 2·2+4·1 = 8, (1,1) 4
    c = np.array([[5 / math.sqrt(50), 3 / math.sqrt(10)], [8 / 10, 4 / math.sqrt(20)]])
    assert cross_correlation(z_a, z_b, "paper").numpy() == pytest.approx(c, abs=1e-6)
    # Eq. 5: (1 − 1/√2)² + (1 − 2/√5)² + λ (0.9 + 0.64)
    expected = (1 - 1 / math.sqrt(2)) ** 2 + (1 - 2 / math.sqrt(5)) ** 2 + LAMBDA * (0.9 + 0.64)
    assert barlow_twins(z_a, z_b, LAMBDA, normalize="paper").item() == pytest.approx(expected, rel=1e-6)


def test_barlow_twins_original_batchnorm_normalisation_by_hand():
    z_a = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 3.0]])
    z_b = torch.tensor([[3.0, 1.0], [2.0, 1.0], [1.0, 4.0]])
    # standardised over the batch (biased std): a0 = [−1, 0, 1]·√1.5, a1 = [−1, −1, 2]/√2,
    # b0 = [1, 0, −1]·√1.5, b1 = [−1, −1, 2]/√2;  C = aᵀb / 3:
    # C00 = −(1.5 + 1.5)/3 = −1, C11 = (1 + 1 + 4)/2/3 = 1, C01 = √0.75·3/3 = √3/2, C10 = −√3/2
    c = np.array([[-1.0, math.sqrt(3) / 2], [-math.sqrt(3) / 2, 1.0]])
    assert cross_correlation(z_a, z_b, "batchnorm").numpy() == pytest.approx(c, abs=1e-6)
    # Eq. 5 on that C: (1 − (−1))² + 0 + λ (3/4 + 3/4)
    assert barlow_twins(z_a, z_b, LAMBDA, normalize="batchnorm").item() == pytest.approx(
        4 + 1.5 * LAMBDA, rel=1e-6
    )


def test_barlow_twins_identical_decorrelated_inputs_give_zero_and_bad_args_raise():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # orthogonal columns: C = I
    assert barlow_twins(z, z, LAMBDA).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="normalisation 'bn'"):
        barlow_twins(z, z, LAMBDA, normalize="bn")
    with pytest.raises(ValueError, match="one shape"):
        barlow_twins(z, z[:1], LAMBDA)


# ----------------------------------------------------------------------------- MOON
def test_moon_term_equals_its_formula_on_fixed_cosines():
    pos, neg, tau = torch.tensor([0.5, -0.2]), torch.tensor([0.1, 0.3]), 0.5
    # −log(e^{pos/τ} / (e^{pos/τ} + e^{neg/τ})) = log(1 + e^{(neg − pos)/τ}), batch mean
    expected = (math.log(1 + math.exp(-0.8)) + math.log(1 + math.exp(1.0))) / 2
    assert moon_from_cosines(pos, neg, tau).item() == pytest.approx(expected, rel=1e-6)
    # on vectors: cos(z, z_glob) = 1, cos(z, z_prev) = 0
    z, zg, zp = torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    assert moon_contrastive(z, zg, zp, tau).item() == pytest.approx(
        math.log(1 + math.exp(-1 / tau)), rel=1e-6
    )


# ----------------------------------------------------------------------------- local training
def _clients(n_clients=2, n=24, size=16, classes=3):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, 255, (n + 6 * c, 3, size, size), generator=g, dtype=torch.uint8),
            torch.arange(n + 6 * c) % classes,
        )
        for c in range(n_clients)
    ]


KW = dict(epochs=1, batch_size=8, lr=0.05, optimizer="sgd", momentum=0.9, weight_decay=0.0)


def _fedavg_rounds(train_fn, rounds=2):
    """Rounds of local training + Flower's weighted FedAvg aggregation on a ProjectedNet."""
    torch.manual_seed(0)
    global_net = build_projected_net("tiny-cnn", 3, 16, proj_dim=8)
    data = _clients()
    for r in range(rounds):
        replies = []
        for c, (x, y) in enumerate(data):
            local = build_projected_net("tiny-cnn", 3, 16, proj_dim=8)
            local.load_state_dict(global_net.state_dict())
            metrics = train_fn(local, frozen_copy(global_net), x, y, seed=100 * r + c)
            replies.append(
                RecordDict(
                    {
                        "arrays": ArrayRecord(local.state_dict()),
                        "metrics": MetricRecord({"num-examples": metrics["num-examples"]}),
                    }
                )
            )
        global_net.load_state_dict(aggregate_arrayrecords(replies, "num-examples").to_torch_state_dict())
    return global_net.state_dict()


def test_flbt_with_mu_zero_gives_the_fedavg_weights():
    fedavg = _fedavg_rounds(lambda m, ref, x, y, seed: train_supervised(m, x, y, seed=seed, **KW))
    flbt0 = _fedavg_rounds(
        lambda m, ref, x, y, seed: train_flbt(m, ref, x, y, mu=0.0, lambd=LAMBDA, seed=seed, **KW)
    )
    flbt = _fedavg_rounds(
        lambda m, ref, x, y, seed: train_flbt(m, ref, x, y, mu=1.0, lambd=LAMBDA, seed=seed, **KW)
    )
    assert all(torch.equal(fedavg[k], flbt0[k]) for k in fedavg)
    assert not all(torch.equal(fedavg[k], flbt[k]) for k in fedavg)  # μ > 0 does change them


@pytest.mark.parametrize("normalize", ["paper", "batchnorm"])
def test_global_reference_is_not_updated_during_local_training(normalize):
    torch.manual_seed(1)
    net = build_projected_net("tiny-cnn", 3, 16, proj_dim=8)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    ref = frozen_copy(net)
    (x, y), _ = _clients()
    metrics = train_flbt(net, ref, x, y, mu=1.0, lambd=LAMBDA, normalize=normalize, seed=3, **KW)
    assert metrics["train_term"] > 0
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(ref.state_dict()[k], before[k]) for k in before)  # incl. BN running stats
    assert not all(torch.equal(net.state_dict()[k], before[k]) for k in before)  # the local model trained


def test_moon_first_round_is_plain_ce_and_later_rounds_use_the_previous_model():
    (x, y), _ = _clients()
    torch.manual_seed(2)
    a = build_projected_net("tiny-cnn", 3, 16, proj_dim=8)
    b = build_projected_net("tiny-cnn", 3, 16, proj_dim=8)
    b.load_state_dict(a.state_dict())
    m_moon = train_moon(a, frozen_copy(a), None, x, y, mu=1.0, tau=0.5, seed=5, **KW)
    m_ce = train_with_model_term(b, x, y, term=None, seed=5, **KW)
    assert m_moon == m_ce and all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    prev = frozen_copy(b)
    m = train_moon(a, frozen_copy(a), prev, x, y, mu=1.0, tau=0.5, seed=6, **KW)
    assert m["train_term"] > 0


# ----------------------------------------------------------------------------- FedBN
def test_fedbn_selects_the_20_batchnorm_modules_of_resnet18_by_type():
    model = create_model("resnet18", num_classes=4, image_size=32)
    keys = batchnorm_keys(model)
    modules = {k.rsplit(".", 1)[0] for k in keys}
    assert len(modules) == 20
    assert {
        "backbone.layer2.0.downsample.1",
        "backbone.layer3.0.downsample.1",
        "backbone.layer4.0.downsample.1",
        "backbone.bn1",
    } <= modules
    # weights, biases and running statistics of each
    assert all(
        {f"{m}.{s}" for s in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")} <= keys
        for m in modules
    )
    # exactly the BatchNorm modules: a name test ("bn" in the name) misses the downsample ones
    by_name = {k for k in model.state_dict() if ".bn" in k or k.startswith("backbone.bn")}
    assert by_name < keys and len(keys - by_name) == 3 * 5
    assert all(isinstance(dict(model.named_modules())[m], torch.nn.BatchNorm2d) for m in modules)


# ----------------------------------------------------------------------------- Table XII counts
def test_parameter_counts_reproduce_table_xii_for_resnet50():
    from fedderm.costs import count_parameters

    plain = create_model("resnet50", num_classes=4, image_size=256)
    projected = build_projected_net("resnet50", 4, 256, proj_dim=128)
    bn = {k for k in batchnorm_keys(plain) if k in dict(plain.named_parameters())}
    assert round(count_parameters(plain) / 1e6, 2) == 23.52  # ResNet50 / FedAvg / FedProx / FedBN
    assert round(count_parameters(projected) / 1e6, 2) == 27.97  # MOON / FL-BT / SSL-FL-BT-S2
    assert round(3 * count_parameters(plain) / 1e6, 2) == 70.55  # FedAvg comm params, 3 centres
    assert round(3 * count_parameters(plain, exclude=bn) / 1e6, 2) == 70.39  # FedBN: BN stays local


def test_macs_per_image_by_hand():
    from fedderm.costs import macs_per_image

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 64, 5)
    )
    # conv: 8 out-channels × 64 positions × (3 × 3 × 3) = 13824; linear: 512 × 5 = 2560
    assert macs_per_image(model, 8) == 13824 + 2560
