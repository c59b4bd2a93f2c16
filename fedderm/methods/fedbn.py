"""FedBN (Li et al. 2021; paper 004 baseline): ``strategies/fedbn.py``, ``clients/fedbn.py``."""

from fedderm.methods import Method, register_method

METHOD = register_method(
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
    )
)
