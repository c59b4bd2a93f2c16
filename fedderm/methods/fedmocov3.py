"""FedMoCo-v3 (paper 003 baseline; MoCo v3, Chen, Xie & He 2021, its reference code's ViT recipe):
``strategies/fedmocov3.py``, ``clients/fedmocov3.py``."""

from fedderm.config import Config
from fedderm.methods import PREFIX_PROBE, SMALL_VIT, VIT_MODELS, Method, need, register_method

MOCOV3_OPTIONS = {
    "mocov3.temperature": 0.2,  # tau of ctr(q, k) (ViT recipes: 0.2)
    "mocov3.momentum": 0.99,  # m of the momentum encoder (reference: 0.99, cosine to 1)
    "mocov3.hidden-dim": 4096,  # hidden width of the projector and predictor MLPs
    "mocov3.proj-dim": 256,  # output size of the projector and predictor
    "mocov3.freeze-patch-embed": True,  # random patch projection (MoCo v3 section 5.2)
}
#: one line per option: the run-config reference (docs/run-config.md)
MOCOV3_DOCS = {
    "mocov3.temperature": "`fedmocov3`: τ of MoCo v3's ctr(q, k) = CE(q·kᵀ/τ) · 2τ (ViT recipe: 0.2)",
    "mocov3.momentum": "`fedmocov3`: m of the momentum encoder, θ_k ← mθ_k + (1 − m)θ_q every step "
    "(MoCo v3's cosine rise to 1 is not implemented)",
    "mocov3.hidden-dim": "`fedmocov3`: hidden width of the projector and predictor MLPs (MoCo v3: 4096)",
    "mocov3.proj-dim": "`fedmocov3`: output size of the projector and predictor (MoCo v3: 256)",
    "mocov3.freeze-patch-embed": "`fedmocov3`: keep the ViT's patch embedding at its random init (MoCo v3 "
    "§5.2, random patch projection)",
}


def check_mocov3(cfg: Config) -> None:
    """The ``mocov3.*`` keys: ranges."""
    o = cfg.option
    need(cfg, o("mocov3.temperature") > 0, "mocov3.temperature", "must be > 0")
    need(cfg, 0 <= o("mocov3.momentum") < 1, "mocov3.momentum", "must be in [0, 1)")
    need(cfg, o("mocov3.hidden-dim") >= 1, "mocov3.hidden-dim", "must be >= 1")
    need(cfg, o("mocov3.proj-dim") >= 1, "mocov3.proj-dim", "must be >= 1")


METHOD = register_method(
    Method(
        "fedmocov3",
        "strategies.fedmocov3",
        "clients.fedmocov3",
        "FedMoCo-v3 (003 baseline): MoCo v3 pre-training of a ViT (prediction head, momentum encoder, "
        "symmetric InfoNCE on in-batch keys, no queue) + FedAvg, then fine-tuning.",
        options=MOCOV3_OPTIONS,
        check=check_mocov3,
        model="vit-base",
        models=VIT_MODELS,
        paper_image_size=224,
        smallest={**SMALL_VIT, "mocov3.hidden-dim": 32, "mocov3.proj-dim": 16},
        probe=PREFIX_PROBE,
        augment="003",
        peft=True,
        docs=MOCOV3_DOCS,
    )
)
