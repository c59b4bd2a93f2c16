"""MAE/BEiT optimiser schedule: warm-up, cosine per iteration, AdamW betas, blr scaling."""

import math

import pytest
import torch
from torch import nn

import registry
from fedderm.config import ConfigError
from fedderm.methods.fedmae import MIM_OPTIONS
from fedderm.train import batch_scaled_lr, epoch_lr, make_optimizer, mim_schedule, train_epochs


def test_epoch_lr_is_the_mae_reference_schedule():
    # MAE util/lr_sched.py: lr·e/W during warm-up, then lr·½(1 + cos(π(e − W)/(T − W)))
    assert epoch_lr(1.0, 0.0, 10, 2) == 0.0
    assert epoch_lr(1.0, 1.0, 10, 2) == pytest.approx(0.5)
    assert epoch_lr(1.0, 2.0, 10, 2) == pytest.approx(1.0)
    assert epoch_lr(1.0, 6.0, 10, 2) == pytest.approx(0.5)
    assert epoch_lr(1.0, 4.0, 10, 2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 8)))
    assert epoch_lr(1.0, 10.0, 10, 2) == pytest.approx(0.0, abs=1e-12)


def test_base_lr_is_scaled_by_batch_over_256():
    assert batch_scaled_lr(7.5e-4, 128) == pytest.approx(3.75e-4)  # 003 Derm Fed-MAE: η 7.5e-4, B 128
    s = mim_schedule(
        7.5e-4,
        server_round=1,
        num_rounds=4,
        local_epochs=1,
        batch_size=128,
        lr_scaling="batch",
        schedule="constant",
    )
    assert s["lr"] == pytest.approx(3.75e-4)
    assert (
        mim_schedule(
            7.5e-4, server_round=1, num_rounds=4, local_epochs=1, batch_size=128, schedule="constant"
        )["lr"]
        == 7.5e-4
    )


def test_betas_reach_the_optimizer():
    p = [nn.Parameter(torch.zeros(2))]
    assert make_optimizer(p, "adamw", 1e-3, betas=(0.9, 0.95)).param_groups[0]["betas"] == (0.9, 0.95)
    assert make_optimizer(p, "adamw", 1e-3).param_groups[0]["betas"] == (0.9, 0.999)
    assert mim_schedule(1e-3, server_round=1, num_rounds=2, local_epochs=1, batch_size=8, adam_beta2=0.95)[
        "betas"
    ] == (0.9, 0.95)


def _record_lrs(lr_at_epoch, epochs=2, n=8, batch=2, betas=(0.9, 0.999)):
    """Run train_epochs on a one-parameter model and record the lr and betas of every step."""
    model = nn.Linear(1, 1)
    seen = []

    def loss_fn(m, xb, yb, g):
        return m(xb.float()).pow(2).mean()

    orig_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        seen.append((self.param_groups[0]["lr"], self.param_groups[0]["betas"]))
        return orig_step(self, *a, **k)

    torch.optim.AdamW.step = step
    try:
        train_epochs(
            model,
            torch.ones(n, 1),
            torch.zeros(n, dtype=torch.long),
            loss_fn,
            epochs=epochs,
            batch_size=batch,
            lr=0.123,
            optimizer="adamw",
            betas=betas,
            lr_at_epoch=lr_at_epoch,
        )
    finally:
        torch.optim.AdamW.step = orig_step
    return seen


def test_per_iteration_schedule_sets_the_lr_before_every_step():
    # round 2 of 3, 2 local epochs of 4 batches: epochs 2.0, 2.25, …, 3.75 of 6, warm-up 3
    kw = mim_schedule(
        1.0,
        server_round=2,
        num_rounds=3,
        local_epochs=2,
        batch_size=2,
        lr_step="iteration",
        warmup_epochs=3,
        adam_beta2=0.95,
    )
    seen = _record_lrs(kw["lr_at_epoch"], betas=kw["betas"])
    expected = [epoch_lr(1.0, 2 + e, 6, 3) for e in (0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75)]
    assert [lr for lr, _ in seen] == pytest.approx(expected)
    assert expected[0] == pytest.approx(2 / 3) and expected[-1] < expected[4]  # warm-up, then decay
    assert all(b == (0.9, 0.95) for _, b in seen)
    # without a schedule the lr is the round's constant
    assert [lr for lr, _ in _record_lrs(None)] == [0.123] * 8


def test_round_step_keeps_the_per_round_cosine():
    kw = mim_schedule(1.0, server_round=2, num_rounds=4, local_epochs=3, batch_size=2)
    assert "lr_at_epoch" not in kw and kw["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_mim_keys_are_checked():
    base = {"method": "fedmae"}
    cfg = registry.load_config({**base, "mim.lr-step": "iteration", "mim.warmup-epochs": 5})
    assert cfg.option("mim.warmup-epochs") == 5
    registry.load_config({"method": "fedbeit", "mim.adam-beta2": 0.95})
    with pytest.raises(ConfigError, match="mim.warmup-epochs"):  # warm-up needs the per-iteration schedule
        registry.load_config({**base, "mim.lr-step": "round", "mim.warmup-epochs": 5})
    with pytest.raises(ConfigError, match="mim.warmup-epochs"):  # also fedmae's default warm-up (5 epochs)
        registry.load_config({**base, "mim.lr-step": "round"})
    with pytest.raises(ConfigError, match="mim.lr-step"):
        registry.load_config({**base, "mim.lr-step": "epoch"})
    with pytest.raises(ConfigError, match="mim.lr-step"):
        registry.load_config({**base, "mim.lr-step": "iteration", "lr-schedule": "exponential"})
    with pytest.raises(ConfigError, match="mim.lr-scaling"):
        registry.load_config({**base, "mim.lr-scaling": "linear"})
    with pytest.raises(ConfigError, match="mim.adam-beta2"):
        registry.load_config({"method": "fedavg", "mim.adam-beta2": 0.95})  # read by fedmae/fedbeit only


def test_mae_and_beit_recipes_are_the_default_schedules_and_a_set_key_wins(tmp_path):
    """With the mim.* keys unset, fedmae pre-trains with the MAE recipe and
    fedbeit with BEiT's (003 §IV-B3); a key set in the run config wins; config.json (to_flat) records
    the resolved values, so a resume reloads exactly them."""
    mae = registry.load_config({"method": "fedmae"})
    assert {k: mae.option(k) for k in MIM_OPTIONS} == {
        "mim.lr-step": "iteration",
        "mim.warmup-epochs": 5,
        "mim.adam-beta2": 0.95,
        "mim.lr-scaling": "batch",
        "mim.optimizer": "adamw",
        "mim.lr": 1.5e-4,
        "mim.weight-decay": 0.05,
    }
    beit = registry.load_config({"method": "fedbeit"})
    assert (beit.option("mim.warmup-epochs"), beit.option("mim.adam-beta2")) == (10, 0.999)
    assert beit.option("mim.lr-step") == "iteration" and beit.option("mim.lr-scaling") == "batch"
    set_ = registry.load_config({"method": "fedmae", "mim.adam-beta2": 0.98, "mim.lr-scaling": "absolute"})
    assert (set_.option("mim.adam-beta2"), set_.option("mim.lr-scaling")) == (0.98, "absolute")
    assert set_.option("mim.warmup-epochs") == 5  # the keys not set keep the recipe
    flat = mae.to_flat()
    assert flat["mim.lr-step"] == "iteration" and registry.load_config(flat) == mae  # resume: same config
    fedavg = registry.load_config({"method": "fedavg"})  # other methods do not read mim.*: left unset
    assert fedavg.option("mim.lr-step") == "" and fedavg.option("mim.warmup-epochs") == -1
    # the pre-training round of the client (clients/common.py) gets the recipe: blr × 32/256, β2 0.95
    from clients.common import ClientSession

    kw = ClientSession(mae, None, torch.device("cpu"), 0, None).mim_kwargs(1, 8)
    assert kw["betas"] == (0.9, 0.95) and "lr_at_epoch" in kw
    assert kw["lr_at_epoch"](5) == pytest.approx(1.5e-4 * 32 / 256)  # the peak, after the 5 warm-up epochs


def test_mim_optimizer_lr_and_weight_decay_are_the_recipes_for_pretraining_only(monkeypatch):
    """Fedmae/fedbeit pre-train with their recipe's optimiser (AdamW, MAE blr 1.5e-4 /
    BEiT 1.5e-3, weight decay 0.05) from ``mim.optimizer``/``mim.lr``/``mim.weight-decay``, not the
    generic ``optimizer``/``lr``/``weight-decay`` (Adam 1e-3, 5e-4); a set key wins; fine-tuning keeps
    its own keys; other methods are untouched."""
    import fedderm.train as train
    from clients.common import ClientSession

    def recipe(cfg):
        return tuple(cfg.option(k) for k in ("mim.optimizer", "mim.lr", "mim.weight-decay"))

    mae, beit = (registry.load_config({"method": m}) for m in ("fedmae", "fedbeit"))
    assert recipe(mae) == ("adamw", 1.5e-4, 0.05) and recipe(beit) == ("adamw", 1.5e-3, 0.05)
    set_ = registry.load_config({"method": "fedbeit", "mim.lr": 3e-3, "mim.optimizer": "adam"})
    assert recipe(set_) == ("adam", 3e-3, 0.05)  # set keys win, the unset one keeps the recipe
    assert registry.load_config(set_.to_flat()) == set_ and registry.load_config(mae.to_flat()) == mae
    fedavg = registry.load_config({"method": "fedavg"})
    assert recipe(fedavg) == ("", -1.0, -1.0)  # not resolved: fedavg does not read them
    assert (fedavg.optimizer, fedavg.lr, fedavg.weight_decay) == ("adam", 1e-3, 5e-4)
    assert (mae.optimizer, mae.lr, mae.weight_decay) == ("adam", 1e-3, 5e-4)  # the core keys stay as they are
    fedavg_kw = ClientSession(fedavg, None, torch.device("cpu"), 0, None).local_kwargs(1, 8)
    assert (fedavg_kw["optimizer"], fedavg_kw["weight_decay"]) == ("adam", 5e-4)
    for bad, key in (({"mim.optimizer": "lamb"}, "mim.optimizer"), ({"mim.lr": 0.0}, "mim.lr")):
        with pytest.raises(ConfigError, match=key):
            registry.load_config({"method": "fedmae", **bad})
    with pytest.raises(ConfigError, match="mim.lr"):
        registry.load_config({"method": "fedavg", "mim.lr": 1e-3})  # read by fedmae/fedbeit only

    made = []
    make = train.make_optimizer
    monkeypatch.setattr(train, "make_optimizer", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    for cfg, blr, beta2 in ((mae, 1.5e-4, 0.95), (beit, 1.5e-3, 0.999)):
        session = ClientSession(cfg, None, torch.device("cpu"), 0, None)
        kw = session.mim_kwargs(1, 8)  # pre-training round 1 of 8, batch 32, 2 local epochs
        train_epochs(
            nn.Linear(1, 1),
            torch.ones(64, 1),
            torch.zeros(64, dtype=torch.long),
            lambda m, xb, yb, g: m(xb.float()).pow(2).mean(),
            **kw,
        )
        opt = made[-1]
        assert type(opt) is torch.optim.AdamW
        group = opt.param_groups[0]
        assert (group["weight_decay"], group["betas"]) == (0.05, (0.9, beta2))
        assert kw["lr_at_epoch"](cfg.option("mim.warmup-epochs")) == pytest.approx(blr * 32 / 256)
        # fine-tuning: its own optimiser and lr, and the core weight decay
        ft = session.local_kwargs(1, 8, finetune=True)
        assert (ft["optimizer"], ft["weight_decay"]) == (cfg.finetune_optimizer, cfg.weight_decay)
        assert (ft["optimizer"], ft["weight_decay"]) == ("adam", 5e-4)
        assert ft["lr"] == pytest.approx(session.lr_at(cfg.finetune_lr, 1, 8))
