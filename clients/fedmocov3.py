"""FedMoCo-v3 client: MoCo v3 (:mod:`fedderm.mocov3`) on all training images (labels unused); the
whole model (query and momentum encoders, predictor) is sent and averaged, as FedMoCo's."""

from fedderm.mocov3 import build_mocov3, mocov3_round

from . import finetune


def _factory(s):
    o = s.cfg.option
    return build_mocov3(s.cfg.model, s.cfg.image_size, o("mocov3.hidden-dim"), o("mocov3.proj-dim"))


def _mocov3_round(s, model, images, labels, **kwargs) -> dict:
    o = s.cfg.option
    return mocov3_round(
        model,
        images,
        temperature=o("mocov3.temperature"),
        key_momentum=o("mocov3.momentum"),
        freeze_patch_embed=o("mocov3.freeze-patch-embed"),
        **kwargs,
    )


pretrain = finetune.pretrain_handler("mocov3", _factory, _mocov3_round)

HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
