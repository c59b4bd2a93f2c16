"""FedMoCo-v3 (paper 003 baseline; MoCo v3, Chen, Xie & He 2021, its reference code's ViT recipe):
``strategies/fedmocov3.py``, ``clients/fedmocov3.py``."""

from fedderm.config import Config
from methods import PREFIX_PROBE, SMALL_VIT, VIT_MODELS, Method, need, register_method

MOCOV3_OPTIONS = {
    "mocov3.temperature": 0.2,  # tau of ctr(q, k) (ViT recipes: 0.2)
    "mocov3.momentum": 0.99,  # m of the momentum encoder (reference: 0.99, cosine to 1)
    "mocov3.hidden-dim": 4096,  # hidden width of the projector and predictor MLPs
    "mocov3.proj-dim": 256,  # output size of the projector and predictor
    "mocov3.freeze-patch-embed": True,  # random patch projection (MoCo v3 section 5.2)
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
    )
)
