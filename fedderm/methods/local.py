"""Single-centre training (paper 004 baseline): ``strategies/local.py``, ``clients/local.py``."""

from fedderm.methods import Method, mean_only, register_method


def check_local(cfg) -> None:
    mean_only(cfg, "local", "every client keeps its own model: nothing is averaged")


METHOD = register_method(
    Method(
        "local",
        "strategies.local",
        "clients.local",
        "Single-centre training: every client trains and tests its own model; no aggregation "
        "(no global model: a held-out centre trains from random weights, 004 Table XI's ResNet50 row).",
        sends=("metrics", "pr-curve"),
        check=check_local,
        model="resnet50",
        paper_image_size=256,
        augment="004",
    )
)
