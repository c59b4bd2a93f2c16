"""The run config, parsed once into a typed, validated object.

Keys are the flat, dash-separated keys of ``[tool.flwr.app.config]`` (``num-server-rounds``);
attributes are their snake_case twins (``cfg.num_server_rounds``).  Method-specific keys are
namespaced (``fedclf.queue-size``), declared by each method in the registry, and read with
``cfg.option("fedclf.queue-size")``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHOICES: dict[str, tuple[str, ...]] = {
    "dataset": ("synthetic", "folder", "csv", "npz"),
    "partition": ("iid", "dirichlet", "source"),
    "optimizer": ("sgd", "adam", "adamw"),
    "lr-schedule": ("constant", "cosine", "exponential"),
    "device": ("auto", "cpu", "cuda"),
    "finetune": ("none", "local", "federated"),
    "finetune-optimizer": ("sgd", "adam", "adamw"),
    "transport-dtype": ("float32", "float16"),
}


class ConfigError(ValueError):
    """A run-config key is unknown, mistyped or out of range; the message names it."""


@dataclass(frozen=True)
class Config:
    """Every run-config key shared by all methods (docs/run-config.md, generated from KEY_DOCS)."""

    method: str = "fedavg"
    seed: int = 0
    # data
    dataset: str = "synthetic"
    data_path: str = ""
    image_dir: str = ""
    classes: str = ""
    site_column: str = "auto"
    skip_bad_files: bool = False
    cache_dir: str = "~/.cache/fedderm"
    image_size: int = 64
    synthetic_sites: int = 0
    synthetic_per_class: int = 100
    # partitions and splits
    partition: str = "source"
    dirichlet_alpha: float = 0.5
    val_fraction: float = 0.2
    test_fraction: float = 0.2
    label_fraction: float = 1.0
    cv_folds: int = 0
    cv_fold: int = 0
    # model and local training
    model: str = "resnet18"
    num_server_rounds: int = 8
    min_clients: int = 2
    local_epochs: int = 2
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 5e-4
    lr_schedule: str = "cosine"
    lr_decay: float = 0.998
    proximal_mu: float = 0.0
    device: str = "auto"
    # fine-tuning stage of the self-supervised methods (after num-server-rounds of pre-training)
    finetune: str = "federated"
    finetune_rounds: int = 5
    finetune_epochs: int = 2
    finetune_lr: float = 1e-4
    finetune_optimizer: str = "adam"
    # fine-tuning of the final global model on a centre held out of the federation (004 Table XI)
    holdout_centre: str = ""
    holdout_epochs: int = 10
    holdout_lr: float = 1e-3
    # results and reliability
    output_dir: str = "~/fedderm-results"
    run_name: str = ""
    resume: str = ""
    keep_checkpoints: int = 3
    round_timeout: float = 3600.0
    targets: str = "0.55,0.65,0.75,0.85"
    transport_dtype: str = "float32"
    # method-specific keys ("<method>.<key>"), validated against the registry's declarations
    options: Mapping[str, Any] = field(default_factory=dict)

    def option(self, key: str) -> Any:
        """The value of a method-specific key such as ``fedclf.queue-size``."""
        try:
            return self.options[key]
        except KeyError:
            raise ConfigError(
                f"unknown method option {key!r}; declared options: {sorted(self.options)}"
            ) from None

    @property
    def class_list(self) -> list[str] | None:
        """``classes`` split on commas (run-config values cannot be lists), or None."""
        names = [c.strip() for c in self.classes.split(",") if c.strip()]
        return names or None

    @property
    def target_list(self) -> list[float]:
        """``targets`` (comma-separated balanced accuracies) as floats, in the order given."""
        try:
            return [float(t) for t in self.targets.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"run-config key 'targets' must be comma-separated numbers like "
                              f"\"0.5,0.6\", got {self.targets!r}") from None

    def to_flat(self) -> dict[str, Any]:
        """The resolved config as flat run-config keys (for ``config.json`` and messages)."""
        flat = {_key(f.name): getattr(self, f.name) for f in _core_fields()}
        flat.update(self.options)
        return dict(sorted(flat.items()))

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir).expanduser().resolve()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser().resolve()


def _core_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.name != "options"]


def _key(attr: str) -> str:
    return attr.replace("_", "-")


def _default(f: dataclasses.Field) -> Any:
    return f.default


def default_config() -> dict[str, Any]:
    """The core keys with their defaults, as flat run-config keys."""
    return {_key(f.name): _default(f) for f in _core_fields()}


def _check_type(key: str, value: Any, default: Any) -> Any:
    """Return ``value`` coerced to the type of ``default``, or raise naming the key."""
    expected = type(default)
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigError(
            f"run-config key {key!r} must be {expected.__name__} (like {default!r}), "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def _check_ranges(cfg: Config) -> None:
    def need(cond: bool, key: str, what: str) -> None:
        if not cond:
            raise ConfigError(f"run-config key {key!r} {what}, got {getattr(cfg, key.replace('-', '_'))!r}")

    for key, allowed in CHOICES.items():
        need(getattr(cfg, key.replace("-", "_")) in allowed, key, f"must be one of {list(allowed)}")
    for key in ("image-size", "num-server-rounds", "local-epochs", "batch-size", "min-clients",
                "synthetic-per-class", "finetune-rounds", "finetune-epochs"):
        need(getattr(cfg, key.replace("-", "_")) >= 1, key, "must be >= 1")
    need(cfg.image_size >= 8, "image-size", "must be >= 8")
    need(cfg.synthetic_sites >= 0, "synthetic-sites", "must be >= 0 (0 = one site per client)")
    need(cfg.dirichlet_alpha > 0, "dirichlet-alpha", "must be > 0")
    need(0 < cfg.label_fraction <= 1, "label-fraction", "must be in (0, 1]")
    need(cfg.cv_folds == 0 or cfg.cv_folds >= 3, "cv-folds", "must be 0 (off) or >= 3 (test, val and train folds)")
    need(0 <= cfg.cv_fold < max(cfg.cv_folds, 1), "cv-fold", "must be in [0, cv-folds)")
    need(0 < cfg.val_fraction < 1, "val-fraction", "must be in (0, 1)")
    need(0 < cfg.test_fraction < 1, "test-fraction", "must be in (0, 1)")
    need(cfg.val_fraction + cfg.test_fraction < 1, "val-fraction",
         "plus test-fraction must leave a training split (< 1)")
    need(cfg.lr > 0, "lr", "must be > 0")
    need(cfg.finetune_lr > 0, "finetune-lr", "must be > 0")
    need(cfg.holdout_epochs >= 1, "holdout-epochs", "must be >= 1")
    need(cfg.holdout_lr > 0, "holdout-lr", "must be > 0")
    need(cfg.round_timeout > 0, "round-timeout", "must be > 0 (seconds)")
    need(cfg.keep_checkpoints >= 0, "keep-checkpoints", "must be >= 0 (0 keeps every round's checkpoint)")
    need(cfg.proximal_mu >= 0, "proximal-mu", "must be >= 0")
    need(0 < cfg.lr_decay <= 1, "lr-decay", "must be in (0, 1]")
    need(all(0 < t <= 1 for t in cfg.target_list), "targets", "must be balanced accuracies in (0, 1]")
    if cfg.dataset != "synthetic":
        need(bool(cfg.data_path), "data-path", f"must name the data for dataset={cfg.dataset!r}")


def parse_config(
    raw: Mapping[str, Any],
    methods: Iterable[str] = ("fedavg",),
    method_options: Mapping[str, Any] | None = None,
) -> Config:
    """Parse a flat run config (``context.run_config``) into a validated :class:`Config`.

    ``methods`` are the valid ``method`` names and ``method_options`` the namespaced keys the
    methods declare, with their defaults.  Missing keys take their defaults; an unknown key,
    a wrong type or an out-of-range value raises :class:`ConfigError` naming the key.
    """
    method_options = dict(method_options or {})
    core = default_config()
    valid = sorted([*core, *method_options])
    values: dict[str, Any] = {}
    options = dict(method_options)
    for key, value in raw.items():
        if key in core:
            values[key.replace("-", "_")] = _check_type(key, value, core[key])
        elif key in method_options:
            options[key] = _check_type(key, value, method_options[key])
        else:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown run-config key {key!r}.{hint} Valid keys: {', '.join(valid)}"
            )
    cfg = Config(**values, options=options)
    methods = sorted(methods)
    if cfg.method not in methods:
        close = difflib.get_close_matches(cfg.method, methods, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown method {cfg.method!r}.{hint} Valid methods: {', '.join(methods)}")
    _check_ranges(cfg)
    return cfg


#: One line per run-config key, core and method option alike (``"lr"``, ``"fedclf.queue-size"``):
#: the source of the generated run-config reference in the docs.  Every new key gets an entry.
KEY_DOCS: dict[str, str] = {
}
