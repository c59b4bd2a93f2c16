"""SCAFFOLD (Karimireddy et al. 2020): ``strategies/scaffold.py``, ``clients/scaffold.py``."""

from fedderm.methods import Method, register_method

METHOD = register_method(
    Method(
        "scaffold",
        "strategies.scaffold",
        "clients.scaffold",
        "SCAFFOLD (Karimireddy et al. 2020): FedAvg with server and client control variates "
        "correcting client drift (trainable parameters only; BatchNorm buffers averaged plainly).",
        sends=("arrays", "control-delta", "metrics"),
    )
)
