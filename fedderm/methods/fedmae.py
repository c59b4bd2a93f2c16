"""FedMAE (paper 000 §IV) and Fed-MAE (003): MAE pre-training; ``strategies/fedmae.py``,
``clients/fedmae.py``, the model in ``fedderm/mae.py``; docs/methods/fedmae-fedbeit.md.  The
masked-image-modelling optimiser keys (``mim.*``) are shared with Fed-BEiT (``methods/fedbeit.py``)."""

from fedderm.config import CHOICES, Config, ConfigError
from fedderm.methods import SMALL_VIT, VIT_MODELS, VIT_PROBE, Method, need, register_method

MIM_LR_STEPS = ("round", "iteration")
MIM_LR_SCALINGS = ("absolute", "batch")
MIM_OPTIMIZERS = CHOICES["optimizer"]
#: the masked-image-modelling optimiser schedule of FedMAE/Fed-MAE and Fed-BEiT (unset: the recipes below)
MIM_OPTIONS = {
    "mim.lr-step": "",  # round: lr-schedule stepped per round | iteration: cosine per iteration (MAE/BEiT)
    "mim.warmup-epochs": -1,  # linear warm-up over the first N local epochs (003: 5 MAE, 10 BEiT)
    "mim.adam-beta2": -1.0,  # AdamW β2 of pre-training (MAE recipe, followed by 000: 0.95; 003: 0.999)
    "mim.lr-scaling": "",  # batch: lr is a base rate, × batch-size/256 (MAE/BEiT) | absolute
    # the pre-training optimiser: fine-tuning keeps finetune-optimizer / finetune-lr / weight-decay
    "mim.optimizer": "",  # MAE/BEiT: adamw
    "mim.lr": -1.0,  # (base) learning rate of pre-training: MAE blr 1.5e-4, BEiT 1.5e-3
    "mim.weight-decay": -1.0,  # MAE/BEiT: 0.05
}
#: one line per option: the run-config reference (docs/run-config.md)
MIM_DOCS = {
    "mim.lr-step": "`fedmae`/`fedbeit` pre-training: `round` steps `lr-schedule` once per round; `iteration` "
    "sets the lr before every step, warm-up then cosine over all rounds × local epochs (MAE/BEiT); "
    '`""`: the method\'s recipe (`iteration`)',
    "mim.warmup-epochs": "`fedmae`/`fedbeit`: linear warm-up over the first N local epochs, counted across rounds "
    '(003 §IV-B3: 5 for MAE, 10 for BEiT); needs `mim.lr-step="iteration"`; `-1`: the method\'s (5 | 10)',
    "mim.adam-beta2": "`fedmae`/`fedbeit`: β2 of the pre-training Adam/AdamW (MAE's recipe, followed by 000: 0.95; "
    "003 and BEiT: 0.999); `-1`: the method's (0.95 | 0.999)",
    "mim.lr-scaling": "`fedmae`/`fedbeit`: `batch` reads `mim.lr` as a base rate, lr = blr × batch-size/256 "
    '(MAE/BEiT); `absolute` uses it as given; `""`: the method\'s (`batch`)',
    "mim.optimizer": "`fedmae`/`fedbeit`: the pre-training optimiser (`optimizer` is not read by it); "
    '`""`: the method\'s (`adamw`, MAE/BEiT)',
    "mim.lr": "`fedmae`/`fedbeit`: the pre-training (base) learning rate (`lr` is not read by it); `-1`: the "
    "method's (MAE blr 1.5e-4, 000 §V-B; BEiT 1.5e-3, 003 Table I)",
    "mim.weight-decay": "`fedmae`/`fedbeit`: the pre-training weight decay (`weight-decay` is then "
    "fine-tuning's); `-1`: the method's (0.05, MAE/BEiT)",
}
#: FedMAE / Fed-MAE pre-training: the MAE recipe (He et al. 2022, followed by 000 §V-B): per-iteration
#: cosine after a linear warm-up (003 §IV-B3: 5 epochs for Fed-MAE), AdamW β2 = 0.95, base rate × batch/256.
#: Without it (Adam 1e-3, no warm-up, cosine per round) pre-training collapsed the encoder
#: (docs/methods/fedmae-fedbeit.md).  The optimiser is MAE's (He et al. 2022, Table 8 of its appendix A.1;
#: 000 §V-B: "AdamW ... 1.5e-4"): AdamW, base lr 1.5e-4, weight decay 0.05.
MAE_RECIPE = {
    "mim.lr-step": "iteration",
    "mim.warmup-epochs": 5,
    "mim.adam-beta2": 0.95,
    "mim.lr-scaling": "batch",
    "mim.optimizer": "adamw",
    "mim.lr": 1.5e-4,
    "mim.weight-decay": 0.05,
}


def check_mim(cfg: Config) -> None:
    """The ``mim.*`` keys: values, and only with the methods whose pre-training reads them."""
    o = cfg.option
    changed = [k for k, v in MIM_OPTIONS.items() if o(k) != v]
    if cfg.method not in ("fedmae", "fedbeit"):
        if changed:
            raise ConfigError(
                f"run-config key {changed[0]!r} applies to the pre-training of 'fedmae' and 'fedbeit' "
                f"only, not to method {cfg.method!r}"
            )
        return
    need(cfg, o("mim.lr-step") in MIM_LR_STEPS, "mim.lr-step", f"must be one of {list(MIM_LR_STEPS)}")
    need(
        cfg,
        o("mim.lr-scaling") in MIM_LR_SCALINGS,
        "mim.lr-scaling",
        f"must be one of {list(MIM_LR_SCALINGS)}",
    )
    need(cfg, o("mim.warmup-epochs") >= 0, "mim.warmup-epochs", "must be >= 0")
    need(cfg, 0 <= o("mim.adam-beta2") < 1, "mim.adam-beta2", "must be in [0, 1)")
    need(cfg, o("mim.optimizer") in MIM_OPTIMIZERS, "mim.optimizer", f"must be one of {list(MIM_OPTIMIZERS)}")
    need(cfg, o("mim.lr") > 0, "mim.lr", "must be > 0")
    need(cfg, o("mim.weight-decay") >= 0, "mim.weight-decay", "must be >= 0")
    need(
        cfg,
        o("mim.warmup-epochs") == 0 or o("mim.lr-step") == "iteration",
        "mim.warmup-epochs",
        'needs mim.lr-step="iteration" (the warm-up is per iteration, as in MAE/BEiT; '
        'with mim.lr-step="round" set mim.warmup-epochs=0)',
    )
    need(
        cfg,
        o("mim.lr-step") == "round" or cfg.lr_schedule == "cosine",
        "mim.lr-step",
        f'"iteration" is the cosine schedule of MAE/BEiT; it needs lr-schedule="cosine", not '
        f'{cfg.lr_schedule!r} (or set mim.lr-step="round" and mim.warmup-epochs=0)',
    )


DECODER_KEYS = ("fedmae.decoder-embed-dim", "fedmae.decoder-depth", "fedmae.decoder-num-heads")


def check_fedmae(cfg: Config) -> None:
    """FedMAE's pre-training keys (``mim.*``) and, for a ``fedmae`` run, its decoder: blocks and heads
    >= 1, the width a multiple of 4 × heads (the 2-D sine-cosine position embedding per head)."""
    check_mim(cfg)
    if cfg.method != "fedmae":
        return
    width, depth, heads = (cfg.option(k) for k in DECODER_KEYS)
    need(cfg, depth >= 1, "fedmae.decoder-depth", "must be >= 1 (or -1: sized to the encoder)")
    need(cfg, heads >= 1, "fedmae.decoder-num-heads", "must be >= 1 (or -1: sized to the width)")
    need(
        cfg,
        width >= 4 and width % (4 * heads) == 0,
        "fedmae.decoder-embed-dim",
        f"must be a positive multiple of 4 × fedmae.decoder-num-heads ({4 * heads}) (or -1: sized to the encoder)",
    )


#: one line per option: the run-config reference (docs/run-config.md)
DOCS = {
    "fedmae.mask-ratio": "share of patches removed per image (000: 0.75; 003's Fed-MAE: 0.6)",
    "fedmae.exclude": "parameters kept on the clients during the rounds (000 Table V): `none`, `decoder`, "
    "`patch-embed`, `decoder-embed`, `cls-token`",
    "fedmae.norm-pix-loss": "`true`: per-patch normalised targets (the MAE reference's option); "
    "000 Eq. 7 uses raw pixels",
    "fedmae.decoder-embed-dim": "decoder width; `-1`: sized to the encoder, 2/3 of its width in 32-wide heads "
    "(the MAE reference's ViT-B proportions: 768 → 512; `vit-micro` → 32); the papers' ViT-B decoder: 512",
    "fedmae.decoder-depth": "decoder blocks; `-1`: 2/3 of the encoder's blocks, at least 1 (ViT-B: 12 → 8, "
    "the reference's; `vit-micro` → 1); the papers': 8",
    "fedmae.decoder-num-heads": "decoder attention heads (the width must be a multiple of 4 × heads); `-1`: "
    "one per 32 channels of the width (the reference's 512 / 16); the papers': 16",
    "fedmae.init-checkpoint": "an MAE checkpoint (the reference's format) to start from; loaded strictly",
    "fedmae.pretrain": "`false`: no federated pre-training; fine-tune from `fedmae.init-checkpoint` or from scratch",
}


METHOD = register_method(
    Method(
        "fedmae",
        "strategies.fedmae",
        "clients.fedmae",
        "FedMAE (000 §IV): MAE pre-training, FedAvg over all but fedmae.exclude (kept on the clients, "
        "averaged once after the last round), then fine-tuning. Fed-MAE (003) = exclude none, mask 0.6.",
        options={
            "fedmae.mask-ratio": 0.75,
            "fedmae.exclude": "cls-token",
            "fedmae.norm-pix-loss": False,
            # -1: sized to the encoder (fedderm.mae.decoder_defaults); 000/003's ViT-B decoder is 512 × 8 × 16
            "fedmae.decoder-embed-dim": -1,
            "fedmae.decoder-depth": -1,
            "fedmae.decoder-num-heads": -1,
            "fedmae.init-checkpoint": "",
            "fedmae.pretrain": True,
            **MIM_OPTIONS,
        },
        # 000 §IV-A: "a learnable class embedding ..., whose state at the Transformer output is the visual
        # representation of the input image" (003's Fed-MAE fine-tunes on average pooling: its presets say so)
        defaults={**MAE_RECIPE, "vit-pool": "token"},
        resolve="fedderm.mae:decoder_defaults",
        sends=("arrays", "metrics", "local-arrays"),
        check=check_fedmae,
        model="vit-base",
        models=VIT_MODELS,
        paper_image_size=224,
        smallest={
            **SMALL_VIT,
            "fedmae.decoder-embed-dim": 32,
            "fedmae.decoder-depth": 1,
            "fedmae.decoder-num-heads": 2,
        },
        probe=VIT_PROBE,
        augment="000",
        peft=True,
        vit_pool=True,
        docs={**DOCS, **MIM_DOCS},
    )
)
