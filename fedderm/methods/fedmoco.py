"""FedMoCo (paper 000 baseline): FedCLF without the feature relay; ``strategies/fedmoco.py``,
``clients/fedmoco.py``.  It reads FedCLF's ``fedclf.*`` MoCo keys (``methods/fedclf.py``)."""

from fedderm.methods import PREFIX_PROBE, Method, register_method

METHOD = register_method(
    Method(
        "fedmoco",
        "strategies.fedmoco",
        "clients.fedmoco",
        "FedMoCo (000 baseline, Fig. 6 'W/o FE'): MoCo pre-training + FedAvg, no feature "
        "relay, then fine-tuning.",
        probe=PREFIX_PROBE,
        peft=True,
    )
)
