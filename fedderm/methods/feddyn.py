"""FedDyn (Acar et al. 2021): ``strategies/feddyn.py``, ``clients/feddyn.py``."""

from fedderm.methods import Method, mean_only, register_method

#: one line per option: the run-config reference (docs/run-config.md)
DOCS = {
    "feddyn.alpha": "α of FedDyn's dynamic regulariser",
}


def check_feddyn(cfg) -> None:
    mean_only(cfg, "feddyn", "its server step θ = mean θ_k − h/α and h's update are built on the mean")


METHOD = register_method(
    Method(
        "feddyn",
        "strategies.feddyn",
        "clients.feddyn",
        "FedDyn (Acar et al. 2021): dynamic regularisation −⟨h_k, θ⟩ + (feddyn.alpha/2)‖θ − θ_global‖² "
        "on the clients, server correction θ = mean θ_k − h/α.",
        options={"feddyn.alpha": 0.01},
        check=check_feddyn,
        docs=DOCS,
    )
)
