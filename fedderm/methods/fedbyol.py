"""FedBYOL (paper 003 baseline): ``strategies/fedbyol.py``, ``clients/fedbyol.py``; its ``byol.*``
keys are read by FedEMA too (``methods/fedema.py``)."""

from fedderm.config import Config
from fedderm.methods import PREFIX_PROBE, Method, need, register_method

BYOL_OPTIONS = {
    "byol.tau": 0.99,  # target EMA rate (FedEMA's framework; BYOL: 0.996 rising to 1)
    "byol.hidden-dim": 4096,  # projector / predictor hidden width (BYOL §3.3)
    "byol.proj-dim": 256,  # projection size (BYOL §3.3)
}
#: one line per option: the run-config reference (docs/run-config.md)
BYOL_DOCS = {
    "byol.tau": "`fedbyol`/`fedema`: EMA rate of BYOL's target network, ξ ← τξ + (1 − τ)θ every step "
    "(FedEMA's 0.99; BYOL's 0.996 → 1 schedule is not implemented)",
    "byol.hidden-dim": "`fedbyol`/`fedema`: hidden width of the projector and predictor MLPs (BYOL: 4096)",
    "byol.proj-dim": "`fedbyol`/`fedema`: output size of the projector and predictor (BYOL: 256)",
}


def check_byol(cfg: Config) -> None:
    """The ``byol.*`` keys and FedEMA's ``fedema.tau``: ranges."""
    o = cfg.option
    need(cfg, 0 <= o("byol.tau") < 1, "byol.tau", "must be in [0, 1)")
    need(cfg, o("byol.hidden-dim") >= 1, "byol.hidden-dim", "must be >= 1")
    need(cfg, o("byol.proj-dim") >= 1, "byol.proj-dim", "must be >= 1")
    need(cfg, 0 < o("fedema.tau") <= 1, "fedema.tau", "must be in (0, 1]")


METHOD = register_method(
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
        probe=PREFIX_PROBE,
        augment="003",
        peft=True,
        docs=BYOL_DOCS,
    )
)
