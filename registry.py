"""The methods' lookup: method name -> :class:`~methods.Method`, and the run config checked against
every method.

Each method declares itself in ``fedderm/methods/<m>.py`` (its options, checks, record keys, paper model),
beside ``strategies/<m>.py`` (what the server does) and ``clients/<m>.py`` (what a client does with a
message); importing :mod:`methods` registers them all.  Nothing here names a method.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Mapping
from typing import Any

from fedderm.config import METHOD_KEYS, Config, ConfigError, parse_config
from fedderm.methods import METHODS, UNSET, VIT_MODELS, Method, register_method

__all__ = [
    "HOLDOUT_SENDS",
    "METHODS",
    "SMALLEST_RUN",
    "UNSET",
    "VIT_MODELS",
    "Method",
    "get_method",
    "load_config",
    "method_options",
    "register_method",
    "smallest_run",
]

#: The smallest run of a method (tiny CNN, 16 px, 8 synthetic images per class, one round of one
#: epoch per stage): what the per-method tests and the communication benchmark start from.
SMALLEST_RUN = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 8,
    "num-server-rounds": 1,
    "local-epochs": 1,
    "batch-size": 8,
    "finetune-rounds": 1,
    "finetune-epochs": 1,
}


def _names(flag: str) -> tuple[str, ...]:
    """The registered methods whose ``Method.<flag>`` is set, by name."""
    return tuple(sorted(n for n, m in METHODS.items() if getattr(m, flag)))


def smallest_run(method: str, **overrides) -> dict:
    """Run-config overrides of ``method``'s smallest run: :data:`SMALLEST_RUN`, the method's own
    ``smallest`` settings, then ``overrides`` (keys as in the run config)."""
    return {**SMALLEST_RUN, "method": method, **get_method(method).smallest, **overrides}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}") from None


def method_options() -> dict[str, Any]:
    """Every namespaced key any method declares, with its default."""
    options: dict[str, Any] = {}
    for m in METHODS.values():
        options.update(m.options)
    return options


def option_docs() -> dict[str, str]:
    """Every namespaced key any method declares, with its one-line description (``Method.docs``)."""
    docs: dict[str, str] = {}
    for m in METHODS.values():
        docs.update(m.docs)
    return docs


def resolve_model(cfg: Config) -> Config:
    """``cfg`` with ``model`` set: an unset model (``""``) takes the method's paper model; an unknown
    one, or one the method cannot train, is a ConfigError naming both."""
    method = METHODS[cfg.method]
    if not cfg.model:
        return dataclasses.replace(cfg, model=method.model)
    from fedderm.models import list_models  # torch: only to check a model the run config names

    known = list_models()
    if cfg.model not in known:
        close = difflib.get_close_matches(cfg.model, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"run-config key 'model': unknown model {cfg.model!r}.{hint} Models: {', '.join(known)}"
        )
    if method.models and cfg.model not in method.models:
        raise ConfigError(
            f"run-config key 'model': method {cfg.method!r} cannot train model {cfg.model!r}; "
            f"it needs one of {', '.join(method.models)} (leave 'model' unset for its "
            f"paper's {method.model!r})"
        )
    return cfg


def resolve_defaults(cfg: Config) -> Config:
    """``cfg`` with the method's values in the keys the run config left unset (:data:`UNSET`): its
    ``defaults`` in its option keys and in the core keys of :data:`METHOD_KEYS` (those the method
    gives none take the key's first value), then what its ``resolve`` function derives from the
    rest of the run config.  The resolved values are what ``config.json`` records and a resume
    reloads."""
    method = METHODS[cfg.method]
    core = {
        key.replace("-", "_"): method.defaults.get(key, values[0])
        for key, values in METHOD_KEYS.items()
        if getattr(cfg, key.replace("-", "_")) in UNSET
    }
    options = {k: v for k, v in method.defaults.items() if k not in METHOD_KEYS and cfg.option(k) in UNSET}
    if core or options:
        cfg = dataclasses.replace(cfg, **core, options={**cfg.options, **options})
    if method.resolve:
        module, _, function = method.resolve.partition(":")
        derived = getattr(importlib.import_module(module), function)(cfg)
        unset = {k: v for k, v in derived.items() if cfg.option(k) in UNSET}
        if unset:
            cfg = dataclasses.replace(cfg, options={**cfg.options, **unset})
    return cfg


def load_config(run_config: Mapping[str, Any]) -> Config:
    """Parse ``context.run_config`` against the core keys and every method's options (each
    method's ``check`` validates the values of its options)."""
    cfg = resolve_defaults(
        resolve_model(parse_config(run_config, methods=METHODS, method_options=method_options()))
    )
    for m in METHODS.values():
        if m.check is not None:
            m.check(cfg)
    if cfg.vit_pool != "avg" and (cfg.model not in VIT_MODELS or not METHODS[cfg.method].vit_pool):
        raise ConfigError(
            f"run-config key 'vit-pool' is {cfg.vit_pool!r}, which needs a ViT model ({', '.join(VIT_MODELS)}) "
            f"and one of the methods {', '.join(_names('vit_pool'))}; got model {cfg.model!r}, "
            f'method {cfg.method!r} (set vit-pool="avg")'
        )
    check_peft(cfg)
    if cfg.probe_every and not METHODS[cfg.method].probe:
        raise ConfigError(
            f"run-config key 'probe-every' is {cfg.probe_every} but method {cfg.method!r} has no "
            "self-supervised pre-training whose encoder could be probed; methods that have one: "
            + ", ".join(sorted(n for n, m in METHODS.items() if m.probe))
            + " (set probe-every=0)"
        )
    if cfg.holdout_centre and not METHODS[cfg.method].network:
        raise ConfigError(
            f"run-config key 'holdout-centre' is set but method {cfg.method!r} has no global model "
            "a held-out centre could fine-tune; methods that support it: "
            + ", ".join(sorted(n for n, m in METHODS.items() if m.network))
        )
    return cfg


def check_peft(cfg: Config) -> None:
    """``peft``, ``lora-*`` and ``init-checkpoint``: only where the run has what they act on."""
    if cfg.peft != "none":
        if not METHODS[cfg.method].peft:
            raise ConfigError(
                f"run-config key 'peft' = {cfg.peft!r} does not apply to method {cfg.method!r}: it needs the "
                f"shared federated fine-tuning stage of {', '.join(_names('peft'))} (for a supervised fine-tuning "
                "of a checkpoint: method='random-init' with init-checkpoint)"
            )
        if cfg.finetune != "federated":
            raise ConfigError(
                f"run-config key 'peft' = {cfg.peft!r} needs finetune='federated', got {cfg.finetune!r}"
            )
        if cfg.holdout_centre:
            raise ConfigError("run-config key 'holdout-centre' is not supported with peft='lora'")
    if cfg.init_checkpoint and not METHODS[cfg.method].init_checkpoint:
        raise ConfigError(
            f"run-config key 'init-checkpoint' applies to methods without pre-training "
            f"({', '.join(_names('init_checkpoint'))}), not {cfg.method!r} (fedmae has fedmae.init-checkpoint)"
        )


#: What a held-out centre (``holdout-centre``) may send: its own test metrics and PR curves.
HOLDOUT_SENDS = ("metrics", "pr-curve")
