"""Augmentation policies per stage, named after their papers (fedderm.augment)."""

import pytest
import torch

import registry
from fedderm.augment import POLICIES, Policy, policy, random_flips
from fedderm.config import ConfigError


@pytest.fixture
def policy_calls(monkeypatch):
    """Every augmentation Policy applied during the test, in call order (a spy on Policy.__call__)."""
    seen = []
    original = Policy.__call__

    def spy(self, x, g):
        seen.append(self)
        return original(self, x, g)

    monkeypatch.setattr(Policy, "__call__", spy)
    return seen


def _images(n=12, size=16, seed=0):
    return torch.randint(
        0, 256, (n, 3, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )


def _dihedral(img, hflip=True, vflip=False):
    """Every image a flip (h, and v if asked) followed by a rotation by k·90° can make."""
    out = []
    for h in (False, True) if hflip else (False,):
        for v in (False, True) if vflip else (False,):
            y = img.flip(-1) if h else img
            y = y.flip(-2) if v else y
            out += [torch.rot90(y, k, dims=(-2, -1)) for k in range(4)]
    return out


@pytest.mark.parametrize("name,stage", sorted(POLICIES))
def test_every_policy_is_deterministic_by_seed_and_keeps_shape(name, stage):
    x = _images()
    aug = policy(name, stage)
    a = aug(x, torch.Generator().manual_seed(3))
    b = aug(x, torch.Generator().manual_seed(3))
    c = aug(x, torch.Generator().manual_seed(4))
    assert a.dtype == torch.uint8 and a.shape == x.shape
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, x)  # something happened to some image


def test_004_policy_only_flips_and_rotates_by_right_angles():
    x = _images(40)
    y = policy("004", "finetune")(x, torch.Generator().manual_seed(0))
    seen = set()
    for img, out in zip(x, y):
        matches = [i for i, cand in enumerate(_dihedral(img)) if torch.equal(cand, out)]
        assert matches, "an output is not a flip/rotation of its input"
        seen.add(matches[0])
    assert len(seen) == 8  # all four rotations, with and without the horizontal flip, occur
    assert policy("004", "pretrain") == policy("004", "finetune")


def test_flip_policy_is_the_former_default_bit_for_bit():
    x = _images()
    assert policy("flip", "pretrain") is random_flips and policy("flip", "finetune") is random_flips
    y = policy("flip", "finetune")(x, torch.Generator().manual_seed(1))
    for img, out in zip(x, y):
        assert any(torch.equal(c, out) for c in (img, img.flip(-1), img.flip(-2), img.flip(-1).flip(-2)))


def test_crop_policies_zoom_and_003_rotates_by_at_most_10_degrees():
    # a centred bright square on black: a crop of a smaller area enlarges it, so bright pixels grow
    x = torch.zeros(30, 3, 32, 32, dtype=torch.uint8)
    x[:, :, 12:20, 12:20] = 255
    bright = (policy("000", "pretrain")(x, torch.Generator().manual_seed(0)) > 127).flatten(1).sum(1)
    assert bright.float().mean() > 64 * 3 * 1.3 and bright.max() > 64 * 3 * 2
    # rotation by ±10° (003 fine-tuning): a horizontal bar tilts, but never by anything near 90°
    bar = torch.zeros(30, 3, 32, 32, dtype=torch.uint8)
    bar[:, :, 15:17, 4:28] = 255
    y = Policy(hflip=False, degrees=10.0)(bar, torch.Generator().manual_seed(0)).float()
    rows = torch.arange(32.0)[None, :, None]
    ink = y[:, 0]
    spread = (
        (ink * (rows - (ink * rows).sum((1, 2), keepdim=True) / ink.sum((1, 2), keepdim=True)) ** 2).sum(
            (1, 2)
        )
        / ink.sum((1, 2))
    ).sqrt()  # vertical spread of the bar, in pixels
    assert spread.max() < 3 and spread.max() > 0.8  # tilted (a flat 2-px bar: 0.5), never by ~90° (6.9)
    # 003 pre-training jitters colours: the mean brightness of a flat grey image changes
    grey = torch.full((20, 3, 8, 8), 128, dtype=torch.uint8)
    means = policy("003", "pretrain")(grey, torch.Generator().manual_seed(0)).float().mean((1, 2, 3))
    assert means.std() > 5


def test_paper_resolves_to_each_methods_paper_and_bad_values_are_named():
    assert registry.METHODS["fedmae"].augment == "000" and registry.METHODS["fedbeit"].augment == "003"
    assert {registry.METHODS[m].augment for m in ("flbt", "ssl-flbt", "fedbn", "moon", "local")} == {"004"}
    assert registry.METHODS["fedavg"].augment == "flip"
    assert policy("paper", "pretrain", "003") == Policy(crop_scale=(0.2, 1.0), jitter=0.4)
    assert policy("paper", "finetune", "003") == Policy(crop_scale=(0.6, 1.0), degrees=10.0)
    assert policy("paper", "finetune", "000") == Policy(crop_scale=(0.08, 1.0))
    assert registry.load_config({"augment": "paper"}).augment == "paper"
    with pytest.raises(ConfigError, match="'augment'"):
        registry.load_config({"augment": "mae"})
    with pytest.raises(TypeError, match="uint8"):
        policy("004", "finetune")(torch.zeros(2, 3, 8, 8), torch.Generator())


@pytest.mark.parametrize("augment", ["flip", "paper"])
def test_fedmae_client_pretrains_and_finetunes_on_the_runs_policy(
    tmp_path, monkeypatch, augment, policy_calls
):
    """The clients apply the run's policy: FedMAE (000) pre-training sees resized crops under
    ``paper`` and flips under ``flip``, as does its fine-tuning stage."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from clients import fedmae as mae_client
    from clients import finetune
    from fedderm.mae import build_mae

    seen = policy_calls
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    run_config = {
        "model": "vit-micro",
        "image-size": 16,
        "fedmae.decoder-embed-dim": 16,
        "fedmae.decoder-depth": 1,
        "fedmae.decoder-num-heads": 2,
        "method": "fedmae",
        "augment": augment,
        "synthetic-per-class": 6,
        "local-epochs": 1,
        "finetune-epochs": 1,
        "batch-size": 8,
        "cache-dir": str(tmp_path),
    }
    ctx = Context(
        run_id=7100 + len(augment),
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config=run_config,
    )
    cfg = registry.load_config(run_config)
    torch.manual_seed(0)
    config = ConfigRecord({"server-round": 1, "num-rounds": 1})
    msg = Message(
        RecordDict({"arrays": ArrayRecord(build_mae(cfg).state_dict()), "config": config}),
        dst_node_id=1,
        message_type="train.pretrain",
    )
    mae_client.pretrain(msg, ctx)
    assert set(seen) == ({Policy(crop_scale=(0.2, 1.0))} if augment == "paper" else set())
    seen.clear()
    from clients.common import session
    from fedderm.models import create_classifier

    clf = create_classifier(session(ctx).cfg, session(ctx).data.num_classes)
    msg = Message(
        RecordDict({"arrays": ArrayRecord(clf.state_dict()), "config": config}),
        dst_node_id=1,
        message_type="train.finetune",
    )
    finetune.train(msg, ctx)
    assert set(seen) == ({Policy(crop_scale=(0.08, 1.0))} if augment == "paper" else set())


@pytest.mark.parametrize("method", ["scaffold", "feddyn", "fedrotation", "ssl-flbt"])
def test_clients_that_flipped_regardless_now_apply_the_runs_policy(
    tmp_path, monkeypatch, method, policy_calls
):
    """SCAFFOLD's and FedDyn's local training, FedRotation's pre-training and SSL-FL-BT's
    GAN stage used random flips whatever ``augment`` said; with ``augment="004"`` they apply 004's
    policy (90° rotations + flips)."""
    import importlib

    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedderm.models import create_model
    from fedderm.rotation import NUM_ROTATIONS

    seen = policy_calls
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    run_config = {
        "method": method,
        "model": "tiny-cnn",
        "image-size": 16,
        "augment": "004",
        "synthetic-per-class": 6,
        "local-epochs": 1,
        "batch-size": 8,
        "cache-dir": str(tmp_path),
        **(
            {"ssl.gan-steps": 2, "ssl.pseudo-per-centre": 4, "ssl.gan-width": 8}
            if method == "ssl-flbt"
            else {}
        ),
    }
    ctx = Context(
        run_id=7200 + len(method),
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config=run_config,
    )
    config = ConfigRecord({"server-round": 1 if method != "ssl-flbt" else 0, "num-rounds": 1})
    kind = {"fedrotation": "train.pretrain", "ssl-flbt": "train.gan"}.get(method, "train")
    content = {"config": config}
    if method != "ssl-flbt":
        classes = NUM_ROTATIONS if method == "fedrotation" else 5
        content["arrays"] = ArrayRecord(create_model("tiny-cnn", classes, 16).state_dict())
    msg = Message(RecordDict(content), dst_node_id=1, message_type=kind)
    client = importlib.import_module(registry.METHODS[method].client)
    client.HANDLERS[kind](msg, ctx)
    assert set(seen) == {Policy(rot90=True)}


def test_ssl_flbt_pretrains_on_pseudo_images_with_the_runs_policy(monkeypatch):
    """The server's pre-training on the pseudo images (004 Eq. 3) augments with the run's policy."""
    from fedderm.ssl_pseudo import pretrain_multitask
    from strategies.ssl_flbt import _pretrain_augment

    cfg = registry.load_config({"method": "ssl-flbt", "augment": "paper"})
    chosen = _pretrain_augment(cfg)
    assert chosen == Policy(rot90=True)
    assert _pretrain_augment(registry.load_config({"method": "ssl-flbt", "augment": "flip"})) is random_flips
    calls = []

    def spy(x, g):
        calls.append(len(x))
        return chosen(x, g)

    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    pretrain_multitask(
        images, torch.arange(8) % 2, model="tiny-cnn", num_centres=2, epochs=1, batch_size=4, augment=spy
    )
    assert calls == [4, 4]
