"""FedSimCLR (paper 000 baseline): ``strategies/fedsimclr.py``, ``clients/fedsimclr.py``."""

from fedderm.methods import PREFIX_PROBE, Method, register_method

#: one line per option: the run-config reference (docs/run-config.md)
DOCS = {
    "fedsimclr.temperature": 'τ of SimCLR\'s NT-Xent (`fedsimclr`, and `ssl.tasks="simclr"`)',
}


METHOD = register_method(
    Method(
        "fedsimclr",
        "strategies.fedsimclr",
        "clients.fedsimclr",
        "FedSimCLR (000 baseline): SimCLR pre-training (in-batch negatives) + FedAvg, then fine-tuning.",
        options={"fedsimclr.temperature": 0.5},
        probe=PREFIX_PROBE,
        peft=True,
        docs=DOCS,
    )
)
