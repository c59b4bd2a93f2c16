"""FedCLF (paper 000 §III): ``strategies/fedclf.py``, ``clients/fedclf.py``, the MoCo model and
losses in ``fedderm/moco.py``; docs/methods/fedclf.md.  Its ``fedclf.*`` MoCo keys are read by
FedMoCo and Local CL too."""

from fedderm.config import AUTO, Config, ConfigError
from fedderm.methods import PREFIX_PROBE, Method, need, register_method

# FedCLF's MoCo keys; FedMoCo and Local CL read queue-size, temperature and momentum too.
FEDCLF_OPTIONS = {
    "fedclf.feature-sharing": AUTO,  # auto: on in a simulation (see feature_sharing); false = FedMoCo
    "fedclf.local-negatives": False,  # false = Eq. 5 (remote negatives only), true = Eq. 4
    "fedclf.queue-size": 1024,  # K: local bank Q_l and negatives bank Q_CL
    "fedclf.temperature": 0.2,  # tau of Eq. 6 (MoCo v2)
    "fedclf.momentum": 0.99,  # EMA coefficient of the momentum encoder
    "fedclf.feature-dtype": "float16",  # features on the wire: float16 | float32
    # private relay (fedderm/relay_privacy.py): clip C, noise multiplier sigma, delta
    "fedclf.relay-clip": 0.0,
    "fedclf.relay-noise-multiplier": 0.0,
    "fedclf.relay-delta": 1e-5,
    # leakage audit (fedderm/leakage.py): membership attack on the relay, ROC-AUC per round
    "fedclf.leakage-audit": False,
    "fedclf.leakage-views": 0,  # augmented views per candidate (min distance over them); 0 = plain image
    "fedclf.leakage-non-members": 0,  # held-out images audited per client (seeded sample); 0 = all
}
#: one line per option: the run-config reference (docs/run-config.md)
FEDCLF_DOCS = {
    "fedclf.feature-sharing": "upload and relay the clients' features (raw MoCo features unless "
    '`fedclf.relay-noise-multiplier` > 0); `"auto"`: on in a simulation, and in a deployment only with the '
    "private relay, else the run stops naming this key (docs/privacy.md); `true`: on; `false` = FedMoCo",
    "fedclf.local-negatives": "`false`: remote negatives only (000 Eq. 5); `true`: local and remote negatives (Eq. 4)",
    "fedclf.queue-size": "K: size of the local bank, of the negatives bank and of each client's upload "
    "(also read by `fedmoco`, `localcl`)",
    "fedclf.temperature": "τ of 000 Eq. 6 (MoCo v2; also read by `fedmoco`, `localcl`)",
    "fedclf.momentum": "EMA coefficient of the momentum encoder (also read by `fedmoco`, `localcl`)",
    "fedclf.feature-dtype": "precision of the relayed features on the wire: `float16` | `float32`",
    "fedclf.relay-clip": "C: every relayed feature vector is clipped to L2 norm C before upload; `0`: off "
    "(docs/privacy.md)",
    "fedclf.relay-noise-multiplier": "σ: Gaussian noise N(0, (σC)²) added to every relayed feature vector; "
    "(ε, δ) per client in summary.json `relay_privacy`; `0`: no noise",
    "fedclf.relay-delta": "δ of the reported (ε, δ) of the private relay",
    "fedclf.leakage-audit": "membership attack on the relay every round (nearest relayed feature); "
    "its ROC-AUC per client in rounds.csv split `leakage-audit`",
    "fedclf.leakage-views": "the audit's augmented views per candidate image (smallest distance over the "
    "plain image and them); `0`: the plain image only",
    "fedclf.leakage-non-members": "the audit's non-members per client: a seeded sample of this many of the "
    "client's held-out (val + test) images, the same every round; `0`: all of them",
}


def check_fedclf(cfg: Config) -> None:
    """The ``fedclf.*`` keys (and ``fedsimclr.temperature``): ranges, and the audit needs the relay."""
    need(cfg, cfg.option("fedclf.queue-size") >= 1, "fedclf.queue-size", "must be >= 1")
    need(cfg, cfg.option("fedclf.temperature") > 0, "fedclf.temperature", "must be > 0")
    need(cfg, 0 <= cfg.option("fedclf.momentum") < 1, "fedclf.momentum", "must be in [0, 1)")
    need(
        cfg,
        cfg.option("fedclf.feature-dtype") in ("float16", "float32"),
        "fedclf.feature-dtype",
        "must be one of ['float16', 'float32']",
    )
    need(cfg, cfg.option("fedsimclr.temperature") > 0, "fedsimclr.temperature", "must be > 0")
    need(
        cfg,
        cfg.option("fedclf.relay-clip") >= 0,
        "fedclf.relay-clip",
        "must be >= 0 (0 = no clipping, no noise)",
    )
    need(
        cfg, cfg.option("fedclf.relay-noise-multiplier") >= 0, "fedclf.relay-noise-multiplier", "must be >= 0"
    )
    need(
        cfg,
        cfg.option("fedclf.relay-noise-multiplier") == 0 or cfg.option("fedclf.relay-clip") > 0,
        "fedclf.relay-clip",
        "must be > 0 when fedclf.relay-noise-multiplier > 0 (the noise is sigma x clip)",
    )
    need(cfg, 0 < cfg.option("fedclf.relay-delta") < 1, "fedclf.relay-delta", "must be in (0, 1)")
    need(
        cfg,
        not cfg.option("fedclf.leakage-audit") or cfg.option("fedclf.feature-sharing") is not False,
        "fedclf.leakage-audit",
        'needs the feature relay (fedclf.feature-sharing = true or "auto"): without it nothing is relayed',
    )
    views = cfg.option("fedclf.leakage-views")
    need(
        cfg,
        isinstance(views, int) and not isinstance(views, bool) and views >= 0,
        "fedclf.leakage-views",
        "must be an integer >= 0",
    )
    non_members = cfg.option("fedclf.leakage-non-members")
    need(
        cfg,
        isinstance(non_members, int) and not isinstance(non_members, bool) and non_members >= 0,
        "fedclf.leakage-non-members",
        "must be an integer >= 0 (0 = every held-out image)",
    )


def feature_sharing(cfg: Config, deployment: bool) -> bool:
    """Whether the run relays features: ``fedclf.feature-sharing`` as set, or for ``"auto"`` on in a
    simulation and, in a ``deployment``, on only with the private relay (noise multiplier > 0); a
    deployment with ``"auto"`` and no noise is a ConfigError naming the key and what it would send."""
    value = cfg.option("fedclf.feature-sharing")
    if value != "auto":
        return bool(value)
    if not deployment or cfg.option("fedclf.relay-noise-multiplier") > 0:
        return True
    raise ConfigError(
        "run-config key 'fedclf.feature-sharing' is \"auto\" in a deployment without the private relay: "
        "every hospital would send the server the raw MoCo features of its training images (one "
        "128-d vector per image, from which membership can be tested), and the server would relay them "
        "to the other hospitals. Set fedclf.feature-sharing = true to accept that, "
        "fedclf.relay-noise-multiplier > 0 (with fedclf.relay-clip > 0) for the differentially private "
        "relay, or false for FedMoCo (docs/privacy.md)"
    )


METHOD = register_method(
    Method(
        "fedclf",
        "strategies.fedclf",
        "clients.fedclf",
        "FedCLF (000 §III): MoCo pre-training + FedAvg with de-identified feature relay "
        "(remote negatives), then fine-tuning.",
        options=FEDCLF_OPTIONS,
        sends=("arrays", "metrics", "features"),
        check=check_fedclf,
        probe=PREFIX_PROBE,
        peft=True,
        docs=FEDCLF_DOCS,
    )
)
