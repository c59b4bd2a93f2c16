"""FedAvg (McMahan et al. 2017): ``strategies/fedavg.py``, ``clients/fedavg.py``; its
model-update privacy (``dp.*``: ``strategies/dp.py``, docs/privacy.md) is shared with FedProx."""

from fedderm.config import Config, ConfigError
from fedderm.methods import VIT_MODELS, Method, register_method

#: model-update privacy (strategies/dp.py): server-side fixed clipping + Gaussian noise
DP_OPTIONS = {
    "dp.mode": "off",  # off | server (client: see check_dp)
    "dp.clip-norm": 1.0,  # C: L2 bound of every client's update w_i - w_global
    "dp.noise-multiplier": 0.0,  # sigma: noise std sigma*C/n on the sum of the clipped updates / n sampled
    "dp.delta": 1e-5,
}
#: one line per option: the run-config reference (docs/run-config.md)
DP_DOCS = {
    "dp.mode": "model-update privacy of `fedavg`/`fedprox`: `off` | `server` (every update clipped to "
    "`dp.clip-norm`, Gaussian noise on the mean; docs/privacy.md)",
    "dp.clip-norm": "C: L2 bound of every client's model update w_i − w_global over its floating-point "
    'arrays, BatchNorm statistics included (`dp.mode = "server"`)',
    "dp.noise-multiplier": "σ: noise std σC/n on w_global + (1/n) Σ clip(Δ_i), n = the clients sampled in the "
    "round; (ε, δ) in summary.json `model_privacy`; `0`: clipping only",
    "dp.delta": "δ of the reported (ε, δ) of the model updates",
}
DP_METHODS = ("fedavg", "fedprox")  # = strategies.dp.DP_METHODS (a method spec imports no strategy)
#: the models ``dp.mode = "server"`` takes: no BatchNorm (the ViTs' LayerNorm normalises every image
#: by itself); the CNNs (``resnet18``, ``resnet50``, ``tiny-cnn``) normalise by running statistics
DP_MODELS = VIT_MODELS


def check_dp(cfg: Config) -> None:
    """``dp.*``: values in range, and ``dp.mode = "server"`` only for the methods and models it fits."""
    mode = cfg.option("dp.mode")
    if mode == "client":
        raise ConfigError(
            "run-config key 'dp.mode' = 'client' is not offered: Flower's fixedclipping_mod needs "
            "exactly one ConfigRecord per train message and fedderm's carry two (config + "
            "fedderm-state); use dp.mode = 'server' (docs/privacy.md)"
        )
    if mode not in ("off", "server"):
        raise ConfigError(f"run-config key 'dp.mode' must be one of ['off', 'server'], got {mode!r}")
    clip, sigma, delta = (cfg.option(k) for k in ("dp.clip-norm", "dp.noise-multiplier", "dp.delta"))
    if not clip > 0:
        raise ConfigError(f"run-config key 'dp.clip-norm' must be > 0, got {clip!r}")
    if not sigma >= 0:
        raise ConfigError(f"run-config key 'dp.noise-multiplier' must be >= 0, got {sigma!r}")
    if not 0 < delta < 1:
        raise ConfigError(f"run-config key 'dp.delta' must be in (0, 1), got {delta!r}")
    if mode == "server" and cfg.aggregation != "mean":
        raise ConfigError(
            f"run-config key 'aggregation' = {cfg.aggregation!r} does not combine with dp.mode = 'server': "
            "its clipping bound and noise are calibrated to the mean of the clipped updates; set "
            'aggregation = "mean" (clipping already bounds what one client can do: docs/privacy.md)'
        )
    if mode != "off" and cfg.method not in DP_METHODS:
        raise ConfigError(
            f"run-config key 'dp.mode' = {mode!r} does not apply to method {cfg.method!r}: server-side "
            f"clipping needs replies that are one full model averaged by FedAvg; methods it applies to: "
            f"{', '.join(DP_METHODS)} (docs/privacy.md, 'Model-update privacy')"
        )
    if mode == "server" and cfg.model not in DP_MODELS:
        raise ConfigError(
            f"run-config key 'model' = {cfg.model!r} has BatchNorm, which dp.mode = 'server' does not take: "
            "the noise on the weights leaves the running statistics wrong and the evaluated model "
            f"diverges (NaN; Opacus refuses BatchNorm under DP too); set model to one of "
            f"{', '.join(DP_MODELS)} (LayerNorm), or dp.mode = 'off' (docs/privacy.md, 'BatchNorm')"
        )


METHOD = register_method(
    Method(
        "fedavg",
        "strategies.fedavg",
        "clients.fedavg",
        "Supervised FedAvg (McMahan et al. 2017), weighted by the clients' labelled images.",
        options=DP_OPTIONS,
        check=check_dp,
        sends=("arrays", "metrics", "val-metrics"),  # val-metrics: wire.VAL_METRICS (val-in-train)
        init_checkpoint=True,
        vit_pool=True,
        docs=DP_DOCS,
    )
)
