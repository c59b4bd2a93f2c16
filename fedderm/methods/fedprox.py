"""FedProx (Li et al. 2020): ``strategies/fedprox.py``; its clients are FedAvg's
(``clients/fedavg.py``, with the proximal term of ``proximal-mu``)."""

from fedderm.methods import Method, register_method
from fedderm.methods.fedavg import DP_DOCS, DP_OPTIONS

METHOD = register_method(
    Method(
        "fedprox",
        "strategies.fedprox",
        "clients.fedavg",
        "Supervised FedProx (Li et al. 2020): FedAvg plus the client-side proximal term "
        "(proximal-mu/2)·‖w − w_global‖².",
        options=DP_OPTIONS,
        sends=("arrays", "metrics", "val-metrics"),
        init_checkpoint=True,
        vit_pool=True,
        docs=DP_DOCS,
    )
)
