"""Fed-BEiT (paper 003 §III-C): ``strategies/fedbeit.py``, ``clients/fedbeit.py``, the model in
``fedderm/beit.py``; docs/methods/fedmae-fedbeit.md.  Its ``mim.*`` keys are FedMAE's
(``methods/fedmae.py``)."""

from fedderm.methods import SMALL_VIT, VIT_MODELS, VIT_PROBE, Method, register_method
from fedderm.methods.fedmae import MAE_RECIPE, MIM_DOCS, MIM_OPTIONS

#: Fed-BEiT pre-training: BEiT's recipe as 003 §IV-B3 states it: warm-up 10 epochs, cosine decay,
#: AdamW β1 = 0.9, β2 = 0.999, base rate × batch/256.  Base rate 1.5e-3: BEiT's pre-training
#: (Bao et al. 2022, appendix: AdamW, lr 1.5e-3, weight decay 0.05) and 003 Table I (Fed-BEiT η on Retina, COVID-FL, Skin-FL).
BEIT_RECIPE = {**MAE_RECIPE, "mim.warmup-epochs": 10, "mim.adam-beta2": 0.999, "mim.lr": 1.5e-3}

#: one line per option: the run-config reference (docs/run-config.md)
DOCS = {
    "fedbeit.mask-ratio": "at most this share of the patches is masked, block-wise (003: 40 %)",
    "fedbeit.vocab-size": "number of visual tokens (DALL-E: 8192)",
    "fedbeit.tokenizer": "a TorchScript tokenizer; empty: the random-projection substitute (not the dVAE)",
}


METHOD = register_method(
    Method(
        "fedbeit",
        "strategies.fedbeit",
        "clients.fedbeit",
        "Fed-BEiT (003 §III-C): block-wise masked visual-token prediction + FedAvg, then fine-tuning.",
        options={
            "fedbeit.mask-ratio": 0.4,
            "fedbeit.vocab-size": 8192,
            "fedbeit.tokenizer": "",
            **MIM_OPTIONS,
        },
        defaults=BEIT_RECIPE,
        model="vit-base",
        models=VIT_MODELS,
        paper_image_size=224,
        smallest={**SMALL_VIT, "fedbeit.vocab-size": 64},
        probe=VIT_PROBE,
        augment="003",
        peft=True,
        vit_pool=True,
        docs={**DOCS, **MIM_DOCS},
    )
)
