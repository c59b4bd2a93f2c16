"""FedEMA (Zhuang et al., ICLR 2022; paper 003 baseline, 004 FedSSL-R/S): FedBYOL with a
divergence-aware EMA on the clients; ``strategies/fedema.py``, ``clients/fedema.py``."""

from fedderm.methods import PREFIX_PROBE, Method, register_method
from fedderm.methods.fedbyol import BYOL_DOCS, BYOL_OPTIONS, check_byol

FEDEMA_OPTIONS = {
    "fedema.tau": 0.7,  # autoscaler target: lambda = tau / divergence at the first EMA update
    "fedema.lambda": -1.0,  # > 0: a fixed lambda instead of the autoscaler
}
#: one line per option: the run-config reference (docs/run-config.md)
FEDEMA_DOCS = {
    "fedema.tau": "FedEMA's autoscaler target τ: λ = τ / ‖W_g − W_k‖ at a client's first EMA update (paper: 0.7)",
    "fedema.lambda": "FedEMA's λ in μ = min(λ‖W_g − W_k‖, 1); `-1` (any value ≤ 0): the autoscaler's",
}

METHOD = register_method(
    Method(
        "fedema",
        "strategies.fedema",
        "clients.fedema",
        "FedEMA (Zhuang et al., ICLR 2022; 003 baseline, 004 FedSSL-R/S): FedBYOL whose clients update "
        "their own online network by the divergence-aware EMA of the global one, then fine-tuning.",
        options={**BYOL_OPTIONS, **FEDEMA_OPTIONS},
        check=check_byol,
        model="resnet50",
        paper_image_size=224,
        smallest={"byol.hidden-dim": 32, "byol.proj-dim": 16},
        probe=PREFIX_PROBE,
        augment="003",
        peft=True,
        docs={**BYOL_DOCS, **FEDEMA_DOCS},
    )
)
