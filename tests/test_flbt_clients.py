"""The 004 client handlers, called directly with Flower messages (no Ray): what they send, what
they keep in their client state (clients.state.client_state)."""

import itertools

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import registry
from clients import fedbn, flbt, local, moon, ssl_flbt
from clients.common import session
from clients.state import client_state
from fedderm.flbt import batchnorm_keys, build_projected_net
from fedderm.models import create_model
from fedderm.msggan import Generator, generate_images, scales_for

_RUN_IDS = itertools.count(1000)
BASE = {
    "image-size": 32,
    "synthetic-per-class": 6,
    "local-epochs": 1,
    "batch-size": 8,
    "num-server-rounds": 2,
    "lr": 0.01,
    "model": "tiny-cnn",
}


@pytest.fixture
def make_context(tmp_path):
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1

    def make(partition=0, **run_config):
        rc = {**BASE, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path), **run_config}
        return Context(
            run_id=next(_RUN_IDS),
            node_id=10 + partition,
            node_config={"partition-id": partition, "num-partitions": 3},
            state=RecordDict(),
            run_config=rc,
        )

    return make


def message(kind, server_round, arrays=None, **config):
    content = RecordDict({"config": ConfigRecord({"server-round": server_round, **config})})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, dst_node_id=10, message_type=kind)


def sent_keys(reply):
    return set(reply.content.keys())


# ----------------------------------------------------------------------------- GAN stage
@pytest.mark.parametrize("size", [32, 28])
def test_msggan_generator_makes_images_of_the_configured_shape(size):
    torch.manual_seed(0)
    gen = Generator(size, latent_dim=16, width=16)
    outs = gen(torch.randn(3, 16))
    assert [o.shape[-1] for o in outs] == scales_for(size) and outs[-1].shape == (3, 3, size, size)
    images = generate_images(gen, 5, seed=1)
    assert images.shape == (5, 3, size, size) and images.dtype == torch.uint8
    assert torch.equal(images, generate_images(gen, 5, seed=1))  # seeded


@pytest.mark.parametrize("fid_select", [False, True])
def test_gan_stage_sends_only_generated_images_none_of_them_real(make_context, fid_select):
    ctx = make_context(
        method="ssl-flbt",
        **{
            "ssl.gan-steps": 4,
            "ssl.pseudo-per-centre": 12,
            "ssl.gan-width": 16,
            "ssl.fid-select": fid_select,
            "ssl.fid-checkpoints": 2,
        },
    )
    reply = ssl_flbt.train_gan(message("train.gan", 0), ctx)
    if fid_select:  # both snapshots scored, the better one uploaded
        metrics = reply.content["metrics"]
        assert {"fid_step2", "fid_step4", "fid_kept0_step"} <= set(metrics)
        best = min((2, 4), key=lambda k: (metrics[f"fid_step{k}"], -k))
        assert metrics["fid_kept0_step"] == best and metrics["fid_selected"] == metrics[f"fid_step{best}"]
    method = registry.get_method("ssl-flbt")
    assert sent_keys(reply) <= set(method.sends) and "train.gan" in method.messages
    # exactly one ArrayRecord, holding exactly one array: the pseudo images, of the configured shape
    assert list(reply.content.array_records) == ["pseudo-images"]
    arrays = reply.content["pseudo-images"]
    assert list(arrays) == ["pseudo-images"]
    pseudo = torch.from_numpy(arrays["pseudo-images"].numpy())
    assert pseudo.shape == (12, 3, 32, 32) and pseudo.dtype == torch.uint8
    # the metrics are scalars only (no list could smuggle pixels)
    assert all(isinstance(v, (int, float)) for v in reply.content["metrics"].values())
    # none equals any real image of this centre (train, val and test), nor of the whole pool
    s = session(ctx)
    centre = torch.cat([s.data.tensors(split)[0] for split in ("train", "val", "test")])
    assert len(centre) == 5 * 6
    for real in (centre, s.data.pool.images):
        same = (pseudo[:, None] == real[None]).flatten(2).all(-1)
        assert not same.any()


# ----------------------------------------------------------------------------- FedBN
def test_fedbn_keeps_the_20_resnet18_batchnorm_modules_local(make_context):
    ctx = make_context(method="fedbn", model="resnet18")
    torch.manual_seed(0)
    init = create_model("resnet18", 5, 32).state_dict()
    bn = batchnorm_keys(create_model("resnet18", 5, 32))
    assert len({k.rsplit(".", 1)[0] for k in bn}) == 20
    reply = fedbn.train(message("train", 1, ArrayRecord(init)), ctx)
    sent = set(reply.content["arrays"].keys())
    assert sent == set(init) - bn  # exactly the non-BN keys leave the client
    assert not any("downsample.1" in k for k in sent) and any("downsample.0" in k for k in sent)
    stored = client_state(ctx).tensors("fedbn-bn-r1")
    assert set(stored) == bn
    trained = session(ctx).model().state_dict()
    assert all(torch.equal(stored[k], trained[k]) for k in bn)
    # round 2: the server's model has no BN keys; the client substitutes its own (round 1)
    shared = {
        k: v + 1.0 if v.is_floating_point() else v
        for k, v in reply.content["arrays"].to_torch_state_dict().items()
    }
    model = fedbn.local_model(message("train", 2, ArrayRecord(shared)), ctx, 1)
    state = model.state_dict()
    assert all(torch.equal(state[k], stored[k]) for k in bn)
    assert all(torch.equal(state[k], shared[k]) for k in shared)
    # evaluation of a model from round 0 uses the BN state the server sent (the initial one) ...
    out = fedbn.evaluate(message("evaluate", 2, ArrayRecord(init), split="val", **{"model-round": 0}), ctx)
    assert 0 <= out.content["metrics"]["accuracy"] <= 1
    assert all(torch.equal(session(ctx).model().state_dict()[k], init[k]) for k in bn)
    # ... and a BN-less model with no local BN state for its round is an error naming the problem
    with pytest.raises(RuntimeError, match="no local BatchNorm state"):
        fedbn.evaluate(message("evaluate", 2, ArrayRecord(shared), split="val", **{"model-round": 0}), ctx)


# ----------------------------------------------------------------------------- MOON, FL-BT, local
def test_moon_persists_the_previous_local_model_per_client(make_context):
    ctx = make_context(method="moon")
    init = ArrayRecord(build_projected_net("tiny-cnn", 5, 32).state_dict())
    r1 = moon.train(message("train", 1, init), ctx)
    assert r1.content["metrics"]["train_term"] == 0  # no previous model yet: plain CE
    prev = client_state(ctx).tensors(moon.PREVIOUS)
    sent = r1.content["arrays"].to_torch_state_dict()
    assert all(torch.equal(prev[k], sent[k]) for k in sent)
    r2 = moon.train(message("train", 2, init), ctx)
    assert r2.content["metrics"]["train_term"] > 0
    other = make_context(partition=1, method="moon")
    assert moon.PREVIOUS not in client_state(other)


def test_flbt_client_takes_mu_from_the_server_and_sends_the_004_network(make_context):
    ctx = make_context(method="flbt", **{"flbt.proj-dim": 16})
    init = build_projected_net("tiny-cnn", 5, 32, proj_dim=16).state_dict()
    with_bt = flbt.train(message("train", 1, ArrayRecord(init), **{"flbt-mu": 0.5}), ctx)
    assert with_bt.content["metrics"]["train_term"] > 0
    assert set(with_bt.content["arrays"].keys()) == set(init)
    assert {"projector.0.weight", "projector.2.weight", "head.weight"} <= set(init)
    without = flbt.train(message("train", 1, ArrayRecord(init), **{"flbt-mu": 0.0}), ctx)
    assert without.content["metrics"]["train_term"] == 0
    test = flbt.evaluate(message("evaluate", 1, ArrayRecord(init), split="test"), ctx)
    curves = test.content["pr-curve"]
    assert {f"ap-{c}" for c in range(5)} <= set(curves.keys())
    assert len(curves["precision-0"]) == len(curves["recall-0"]) <= 101
    assert test.content["metrics"]["ap"] == pytest.approx(np.mean([curves[f"ap-{c}"] for c in range(5)]))


def test_local_client_sends_no_weights_and_tests_its_own_best_model(make_context):
    ctx = make_context(method="local")
    init = ArrayRecord(create_model("tiny-cnn", 5, 32).state_dict())
    local.evaluate(message("evaluate", 0, init, split="val"), ctx)
    r1 = local.train(message("train", 1, init), ctx)
    assert "arrays" not in r1.content and sent_keys(r1) <= set(registry.get_method("local").sends)
    local.evaluate(message("evaluate", 1, split="val"), ctx)
    best_round = int(client_state(ctx).meta(local.BEST)["round"])
    test = local.evaluate(message("evaluate", 2, split="test"), ctx)
    assert test.content["metrics"]["best-round"] == best_round
    with pytest.raises(RuntimeError, match="no model yet"):
        local.train(message("train", 1), make_context(partition=2, method="local"))
