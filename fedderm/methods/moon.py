"""MOON (Li, He & Song 2021; paper 004 baseline): ``strategies/moon.py``, ``clients/moon.py``.
The ranges of its ``moon.*`` keys are checked with FL-BT's (``methods/flbt.py``)."""

from fedderm.methods import Method, register_method

#: one line per option: the run-config reference (docs/run-config.md)
DOCS = {
    "moon.mu": "MOON's μ (weight of the model-contrastive loss)",
    "moon.tau": "MOON's temperature τ",
}


METHOD = register_method(
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
        docs=DOCS,
    )
)
