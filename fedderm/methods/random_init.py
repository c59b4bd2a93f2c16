"""Random init (paper 000 baseline): the shared fine-tuning stage alone; ``strategies/random_init.py``,
``clients/finetune.py``."""

from fedderm.methods import Method, register_method

METHOD = register_method(
    Method(
        "random-init",
        "strategies.random_init",
        "clients.finetune",
        "Random init (000 baseline): no pre-training, fine-tuning of a randomly initialised model.",
        peft=True,
        init_checkpoint=True,
        vit_pool=True,
    )
)
