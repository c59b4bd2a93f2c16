"""Local CL (paper 000 baseline): MoCo on each client alone; ``strategies/localcl.py``,
``clients/localcl.py``.  It reads FedCLF's ``fedclf.*`` MoCo keys (``methods/fedclf.py``)."""

from fedderm.methods import PREFIX_PROBE, Method, register_method

METHOD = register_method(
    Method(
        "localcl",
        "strategies.localcl",
        "clients.localcl",
        "Local CL (000 baseline): MoCo pre-training on each client alone (no aggregation), "
        "then fine-tuning from each client's own backbone.",
        probe=PREFIX_PROBE,
    )
)
