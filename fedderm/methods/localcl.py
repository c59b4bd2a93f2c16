"""Local CL (paper 000 baseline): MoCo on each client alone; ``strategies/localcl.py``,
``clients/localcl.py``.  It reads FedCLF's ``fedclf.*`` MoCo keys (``methods/fedclf.py``)."""

from fedderm.methods import PREFIX_PROBE, Method, mean_only, register_method


def check_localcl(cfg) -> None:
    mean_only(cfg, "localcl", "every client pre-trains its own model: nothing is averaged")


METHOD = register_method(
    Method(
        "localcl",
        "strategies.localcl",
        "clients.localcl",
        "Local CL (000 baseline): MoCo pre-training on each client alone (no aggregation), "
        "then fine-tuning from each client's own backbone.",
        probe=PREFIX_PROBE,
        check=check_localcl,
    )
)
