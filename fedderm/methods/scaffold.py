"""SCAFFOLD (Karimireddy et al. 2020): ``strategies/scaffold.py``, ``clients/scaffold.py``."""

from fedderm.methods import Method, mean_only, register_method


def check_scaffold(cfg) -> None:
    mean_only(
        cfg,
        "scaffold",
        "its model step x + (1/|S|) Σ Δy_i goes with the control variates' mean c + (1/N) Σ Δc_i (Alg. 1)",
    )


METHOD = register_method(
    Method(
        "scaffold",
        "strategies.scaffold",
        "clients.scaffold",
        "SCAFFOLD (Karimireddy et al. 2020): FedAvg with server and client control variates "
        "correcting client drift (trainable parameters only; BatchNorm buffers averaged plainly).",
        sends=("arrays", "control-delta", "metrics"),
        check=check_scaffold,
    )
)
