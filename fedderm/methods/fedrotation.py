"""FedRotation (paper 000 baseline): ``strategies/fedrotation.py``, ``clients/fedrotation.py``."""

from fedderm.methods import PREFIX_PROBE, Method, register_method

METHOD = register_method(
    Method(
        "fedrotation",
        "strategies.fedrotation",
        "clients.fedrotation",
        "FedRotation (000 baseline): rotation-prediction pre-training + FedAvg, then fine-tuning.",
        probe=PREFIX_PROBE,
        peft=True,
    )
)
