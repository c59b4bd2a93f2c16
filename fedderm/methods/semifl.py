"""Semi-FL (Yang et al. 2021; paper 003 Fig. 10b): ``strategies/semifl.py``, ``clients/semifl.py``."""

from fedderm.config import Config
from fedderm.methods import Method, need, register_method

#: labelled CE + consistency loss on the clients' unlabelled images
SEMIFL_OPTIONS = {
    "semifl.weight": 1.0,  # w of the consistency loss (not stated in 003)
    "semifl.threshold": 0.0,  # confidence threshold of the pseudo labels (003: none)
    "semifl.supervised-rounds": -1,  # rounds of labelled CE only; -1: half of num-server-rounds (003)
}
#: one line per option: the run-config reference (docs/run-config.md)
SEMIFL_DOCS = {
    "semifl.weight": "`semifl`: weight w of the consistency loss on the unlabelled images (003: not stated)",
    "semifl.threshold": "`semifl`: pseudo labels below this confidence are masked out (FixMatch); `0`: all "
    "kept (003 states none)",
    "semifl.supervised-rounds": "`semifl`: rounds of labelled cross-entropy only before the joint phase; "
    "`-1`: half of `num-server-rounds` (003: 400 + 400 epochs)",
}


def check_semifl(cfg: Config) -> None:
    """The ``semifl.*`` keys: ranges."""
    o = cfg.option
    need(cfg, o("semifl.weight") >= 0, "semifl.weight", "must be >= 0")
    need(cfg, 0 <= o("semifl.threshold") < 1, "semifl.threshold", "must be in [0, 1)")
    need(cfg, o("semifl.supervised-rounds") >= -1, "semifl.supervised-rounds", "must be >= -1")


METHOD = register_method(
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
        docs=SEMIFL_DOCS,
    )
)
