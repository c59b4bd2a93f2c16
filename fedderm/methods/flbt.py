"""FL-BT (paper 004 §III-B): ``strategies/flbt.py``, ``clients/flbt.py``, the 004 network in
``fedderm/flbt.py`` (shared stages: ``strategies/flbt_family.py``, ``clients/flbt_family.py``);
docs/methods/flbt.md.  Its check covers the whole 004 family's keys (``flbt.*``, ``moon.*``, ``ssl.*``)."""

from fedderm.config import Config
from fedderm.methods import Method, need, register_method
from fedderm.methods.ssl_flbt import SSL_FINETUNE, SSL_PRETRAIN, SSL_TASKS

BT_NORMALISATIONS = ("paper", "batchnorm")  # = fedderm.losses.BT_NORMALISATIONS (no torch here)


def check_flbt(cfg: Config) -> None:
    """Ranges of the 004 keys (flbt.*, moon.*, ssl.*): checked when the config is parsed."""
    o = cfg.option
    need(
        cfg,
        o("flbt.normalize") in BT_NORMALISATIONS,
        "flbt.normalize",
        f"must be one of {list(BT_NORMALISATIONS)}",
    )
    for key in ("flbt.mu", "flbt.lambda", "moon.mu"):
        need(cfg, o(key) >= 0, key, "must be >= 0")
    need(cfg, o("flbt.proj-dim") >= 1, "flbt.proj-dim", "must be >= 1")
    need(cfg, o("moon.tau") > 0, "moon.tau", "must be > 0")
    for key, allowed in (
        ("ssl.pretrain", SSL_PRETRAIN),
        ("ssl.tasks", SSL_TASKS),
        ("ssl.finetune", SSL_FINETUNE),
    ):
        need(cfg, o(key) in allowed, key, f"must be one of {list(allowed)}")
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
        need(cfg, o(key) >= 1, key, "must be >= 1")
    for key in ("ssl.gan-lr", "ssl.lr"):
        need(cfg, o(key) > 0, key, "must be > 0")
    need(cfg, o("ssl.swap-patch") >= 0, "ssl.swap-patch", "must be >= 0 (0 = image-size/8)")
    need(
        cfg,
        o("ssl.fid-keep") <= o("ssl.fid-checkpoints"),
        "ssl.fid-keep",
        f"must be <= ssl.fid-checkpoints ({o('ssl.fid-checkpoints')})",
    )
    if o("ssl.pretrain") == "pseudo":
        need(
            cfg,
            o("ssl.tasks") != "simclr",
            "ssl.tasks",
            '\'simclr\' needs original images (ssl.pretrain="local" or "federated"), not pseudo images',
        )
    else:
        need(
            cfg,
            o("ssl.tasks") in ("restoration", "simclr"),
            "ssl.tasks",
            f"must be 'restoration' or 'simclr' with ssl.pretrain={o('ssl.pretrain')!r} "
            "(centre classification needs images of every centre in one place)",
        )


#: one line per option: the run-config reference (docs/run-config.md)
DOCS = {
    "flbt.mu": "μ of 004 Eq. 7 (weight of the Barlow Twins term)",
    "flbt.lambda": "λ of 004 Eq. 5 (off-diagonal weight)",
    "flbt.normalize": "`paper` (004 Eq. 6) | `batchnorm` (original Barlow Twins)",
    "flbt.proj-dim": "projector output size (128 gives 004 Table XII's 27.97 M parameters for ResNet-50)",
}


METHOD = register_method(
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
        docs=DOCS,
    )
)
