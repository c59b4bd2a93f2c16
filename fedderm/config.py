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

from fedderm.paths import MAX_COMPONENT, is_safe_component
from fedderm.transport import TRANSPORT_DTYPES

#: values of ``bn-stats``: what a local loop's BatchNorm running statistics hold (fedderm.train.RoundStats)
BN_STATS = ("round", "ema")

#: values of ``augment``: ``paper`` = the method's own paper's policy (``Method.augment``; fedderm.augment)
AUGMENT_POLICIES = ("flip", "paper", "000", "003", "004")

#: values of ``dataset`` that need no ``data-path``: generated, or bundled with scikit-learn (docs/data.md)
EMBEDDED_DATASETS = ("synthetic", "digits", "stained-digits")
#: Core keys whose default is the method's: declared unset (``""``), a run takes its method's value
#: (``Method.defaults``) or, where the method gives none, the first value listed (``registry.resolve_defaults``).
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "vit-pool": ("avg", "token"),  # FedMAE: token (000 §IV-A); the others avg (MAE's fine-tuning, 003 §III-D)
}

CHOICES: dict[str, tuple[str, ...]] = {
    "dataset": (*EMBEDDED_DATASETS, "folder", "csv", "npz"),
    "partition": ("iid", "dirichlet", "source"),
    "optimizer": ("sgd", "adam", "adamw"),
    "lr-schedule": ("constant", "cosine", "exponential"),
    "device": ("auto", "cpu", "cuda"),
    "precision": ("fp32", "bf16", "fp16"),
    "finetune": ("none", "local", "federated"),
    "finetune-optimizer": ("sgd", "adam", "adamw"),
    "peft": ("none", "lora"),
    "transport-dtype": TRANSPORT_DTYPES,
    "test-set": ("per-client", "global"),
    "augment": AUGMENT_POLICIES,
    "bn-stats": BN_STATS,
    "vit-pool": ("", *METHOD_KEYS["vit-pool"]),
    "aggregation": ("mean", "median", "trimmed-mean", "krum", "multi-krum", "bulyan"),
}


class ConfigError(ValueError):
    """A run-config key is unknown, mistyped or out of range; the message names it."""


class BoolOrAuto(str):
    """The declared default ``"auto"`` of a key that also takes ``true`` or ``false``: the run
    decides what ``"auto"`` means (e.g. ``fedclf.feature-sharing``: on in a simulation only)."""

    type_name = 'bool or "auto"'


#: the default of a key that takes ``true``, ``false`` or ``"auto"``
AUTO = BoolOrAuto("auto")


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
    synthetic_per_class: int = 40
    # partitions and splits
    partition: str = "source"
    dirichlet_alpha: float = 0.5
    val_fraction: float = 0.2
    test_fraction: float = 0.2
    test_set: str = "per-client"
    test_data_path: str = ""
    label_fraction: float = 1.0
    cv_folds: int = 0
    cv_fold: int = 0
    # model and local training
    model: str = ""  # "": the method's paper model (Method.model, fedderm/methods/<m>.py)
    vit_pool: str = ""  # "": the method's representation (Method.defaults; else "avg")
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
    precision: str = "fp32"
    compile: bool = False
    augment: str = "flip"
    bn_stats: str = "round"
    # fine-tuning stage of the self-supervised methods (after num-server-rounds of pre-training)
    finetune: str = "federated"
    finetune_rounds: int = 5
    finetune_epochs: int = 2
    finetune_lr: float = 1e-4
    finetune_optimizer: str = "adam"
    finetune_batch_size: int = 0
    # parameter-efficient fine-tuning (fedderm/lora.py) and a backbone from a local file
    peft: str = "none"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = ""
    peft_personal: bool = False
    init_checkpoint: str = ""
    # fine-tuning of the final global model on a centre held out of the federation (004 Table XI)
    holdout_centre: str = ""
    holdout_epochs: int = 10
    holdout_lr: float = 1e-3
    # results and reliability
    output_dir: str = "~/fedderm-results"
    run_name: str = ""
    resume: str = ""
    keep_checkpoints: int = 2
    round_timeout: float = 3600.0
    targets: str = "0.55,0.65,0.75,0.85"
    transport_dtype: str = "float32"
    val_in_train: bool = True
    tensorboard: bool = True
    probe_every: int = 0
    # privacy randomness (fedderm/noise.py)
    insecure_reproducible_noise: bool = False
    # screening and robust aggregation of the clients' replies (strategies/screening.py, strategies/robust.py)
    aggregation: str = "mean"
    byzantine_clients: int = 1
    trimmed_mean_beta: float = 0.2
    multi_krum_select: int = 0
    max_update_norm: float = 0.0
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
            raise ConfigError(
                f"run-config key 'targets' must be comma-separated numbers like "
                f'"0.5,0.6", got {self.targets!r}'
            ) from None

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
    if expected is BoolOrAuto:
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(
                f'run-config key {key!r} must be true, false or "auto", got {type(value).__name__} {value!r}'
            )
        return value
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
    for key in (
        "image-size",
        "num-server-rounds",
        "local-epochs",
        "batch-size",
        "min-clients",
        "synthetic-per-class",
        "finetune-rounds",
        "finetune-epochs",
    ):
        need(getattr(cfg, key.replace("-", "_")) >= 1, key, "must be >= 1")
    need(cfg.image_size >= 8, "image-size", "must be >= 8")
    need(cfg.seed >= 0, "seed", "must be >= 0")
    need(cfg.synthetic_sites >= 0, "synthetic-sites", "must be >= 0 (0 = one site per client)")
    need(cfg.dirichlet_alpha > 0, "dirichlet-alpha", "must be > 0")
    need(0 < cfg.label_fraction <= 1, "label-fraction", "must be in (0, 1]")
    need(
        cfg.cv_folds == 0 or cfg.cv_folds >= 3,
        "cv-folds",
        "must be 0 (off) or >= 3 (test, val and train folds)",
    )
    need(0 <= cfg.cv_fold < max(cfg.cv_folds, 1), "cv-fold", "must be in [0, cv-folds)")
    need(0 < cfg.val_fraction < 1, "val-fraction", "must be in (0, 1)")
    need(0 < cfg.test_fraction < 1, "test-fraction", "must be in (0, 1)")
    need(
        cfg.val_fraction + cfg.test_fraction < 1,
        "val-fraction",
        "plus test-fraction must leave a training split (< 1)",
    )
    need(cfg.lr > 0, "lr", "must be > 0")
    need(cfg.finetune_lr > 0, "finetune-lr", "must be > 0")
    need(cfg.finetune_batch_size >= 0, "finetune-batch-size", "must be >= 0 (0 = batch-size)")
    need(cfg.lora_rank >= 1, "lora-rank", "must be >= 1")
    need(cfg.lora_alpha > 0, "lora-alpha", "must be > 0")
    need(0 <= cfg.lora_dropout < 1, "lora-dropout", "must be in [0, 1)")
    need(not cfg.peft_personal or cfg.peft != "none", "peft-personal", 'needs peft="lora"')
    need(cfg.holdout_epochs >= 1, "holdout-epochs", "must be >= 1")
    need(cfg.holdout_lr > 0, "holdout-lr", "must be > 0")
    need(cfg.round_timeout > 0, "round-timeout", "must be > 0 (seconds)")
    need(cfg.keep_checkpoints >= 0, "keep-checkpoints", "must be >= 0 (0 keeps every round's checkpoint)")
    need(
        not cfg.run_name or is_safe_component(cfg.run_name),
        "run-name",
        f"must be one folder name inside output-dir (letters, digits, '.', '_', '-'; not starting with "
        f"'.' or '-'; no '/' or '..'; at most {MAX_COMPONENT} characters)",
    )
    need(cfg.proximal_mu >= 0, "proximal-mu", "must be >= 0")
    need(cfg.probe_every >= 0, "probe-every", "must be >= 0 (0 = off)")
    need(0 < cfg.lr_decay <= 1, "lr-decay", "must be in (0, 1]")
    need(all(0 < t <= 1 for t in cfg.target_list), "targets", "must be balanced accuracies in (0, 1]")
    if cfg.dataset not in EMBEDDED_DATASETS:
        need(bool(cfg.data_path), "data-path", f"must name the data for dataset={cfg.dataset!r}")
    need(cfg.max_update_norm >= 0, "max-update-norm", "must be >= 0 (0 = off)")
    need(cfg.byzantine_clients >= 0, "byzantine-clients", "must be >= 0")
    need(0 <= cfg.trimmed_mean_beta < 0.5, "trimmed-mean-beta", "must be in [0, 0.5)")
    need(
        cfg.multi_krum_select >= 0,
        "multi-krum-select",
        "must be >= 0 (0 = the replies less byzantine-clients)",
    )
    _check_aggregation(cfg)


def robust_needs(cfg: Config) -> tuple[int, str]:
    """The fewest replies ``aggregation`` needs to tolerate ``byzantine-clients`` = f bad ones, and why
    (Krum: n > 2f + 2, Blanchard et al. 2017; Bulyan: n ≥ 4f + 3, El Mhamdi et al. 2018; the median
    is outvoted by f of n < 2f + 1)."""
    f = cfg.byzantine_clients
    return {
        "mean": (1, "one reply"),
        "median": (2 * f + 1, "the median of n replies holds against fewer than n/2 bad ones: n >= 2f + 1"),
        "trimmed-mean": (1, ""),
        "krum": (2 * f + 3, "Krum scores each reply by its n - f - 2 nearest: n >= 2f + 3"),
        "multi-krum": (2 * f + 3, "Krum scores each reply by its n - f - 2 nearest: n >= 2f + 3"),
        "bulyan": (4 * f + 3, "Bulyan selects n - 2f replies by Krum, then trims 2f: n >= 4f + 3"),
    }[cfg.aggregation]


def _check_aggregation(cfg: Config) -> None:
    """Robust aggregation: enough clients for ``byzantine-clients`` (every round aggregates at least
    ``min-clients`` replies: fewer keep the global model), checked before the run."""
    f, n, rule = cfg.byzantine_clients, cfg.min_clients, cfg.aggregation
    need, why = robust_needs(cfg)
    if n < need:
        raise ConfigError(
            f"run-config key 'min-clients' = {n} is too few for aggregation = {rule!r} with "
            f"byzantine-clients = {f}: it needs {need} ({why}); raise min-clients (and start as many "
            "clients) or lower byzantine-clients"
        )
    cut = int(cfg.trimmed_mean_beta * n)
    if rule == "trimmed-mean" and cut < f:
        raise ConfigError(
            f"run-config key 'trimmed-mean-beta' = {cfg.trimmed_mean_beta!r} cuts int({cfg.trimmed_mean_beta!r} x "
            f"min-clients = {n}) = {cut} replies from each end of every coordinate, fewer than "
            f"byzantine-clients = {f}: raise trimmed-mean-beta (< 0.5) or min-clients"
        )
    if rule == "multi-krum" and cfg.multi_krum_select > n - f:
        raise ConfigError(
            f"run-config key 'multi-krum-select' = {cfg.multi_krum_select} is more than min-clients - "
            f"byzantine-clients = {n - f}: a selection that large can include the bad replies (0 = n - f)"
        )


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
            raise ConfigError(f"unknown run-config key {key!r}.{hint} Valid keys: {', '.join(valid)}")
    cfg = Config(**values, options=options)
    methods = sorted(methods)
    if cfg.method not in methods:
        close = difflib.get_close_matches(cfg.method, methods, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown method {cfg.method!r}.{hint} Valid methods: {', '.join(methods)}")
    _check_ranges(cfg)
    return cfg


#: One line per core run-config key (``"lr"``): the source of the generated run-config reference in
#: the docs.  Every new core key gets an entry; a method's options have theirs in its ``Method.docs``.
KEY_DOCS: dict[str, str] = {
    # -- core keys (Config) --
    "method": "the method (`registry.METHODS`; the table in docs/index.md)",
    "seed": "seeds data, partitions, splits, initial weights and shuffling: same seed, same numbers on CPU, "
    "with any number of clients; never the privacy noise (`insecure-reproducible-noise`)",
    "dataset": "the data format (docs/data.md); `synthetic`, `digits` and `stained-digits` (digits in "
    "per-centre H&E-like stains, contrast, blur and noise) are embedded",
    "data-path": "the image folder, CSV file or `.npz` file (not needed for `synthetic`, `digits`, `stained-digits`)",
    "image-dir": "`csv` only: the folder searched (recursively) for the images; default: the CSV's folder",
    "classes": 'comma-separated class list, e.g. `"akiec,bcc,bkl,df,mel,nv,vasc"`: fixes the label order; '
    "empty: inferred from the data (a MedMNIST `.npz` named after its data set gets MedMNIST's names)",
    "site-column": "`csv` only: the column naming each image's site; `auto` uses HAM10000's `dataset` column, "
    '`""` means none',
    "skip-bad-files": "`true` skips unreadable images, missing files and unknown labels (logged) instead of stopping",
    "cache-dir": "decoded, resized images are cached here, so each file is decoded once",
    "image-size": "images are resized (shorter edge) and centre-cropped to this square size (000 uses 72)",
    "synthetic-sites": "`synthetic`, `digits` and `stained-digits`: the number of sites (centres); `0` gives one "
    "site per client",
    "synthetic-per-class": "`synthetic` only: images per class per site",
    "partition": "`source`: one site per client (000 §V-A); `iid`: shuffled equal shares; "
    "`dirichlet`: label proportions ~ Dir(α) per class (003 §IV-B)",
    "dirichlet-alpha": 'α of `partition="dirichlet"`: 100 is near-balanced, 1.0 and 0.5 increasingly skewed',
    "val-fraction": "share of each client's images held out for validation (best-round selection)",
    "test-fraction": "share held out for the final test; the rest is train",
    "test-set": "`per-client`: each client's own test split, metrics averaged over clients (000, 004); "
    "`global`: one test set held out before partitioning (a MedMNIST npz's `test_*`, else a "
    "stratified `test-fraction`), never trained on; `final` reports it (002, 003; docs/test-sets.md)",
    "test-data-path": '`test-set="global"`: a separate test set (same `dataset` format and classes; an npz\'s '
    "`test_*` arrays) instead of one held out of `data-path`; needed with hospitals' own data",
    "label-fraction": "stratified share of train that is labelled (papers: 0.1, 0.2, 0.4, 0.8); the rest is unlabelled",
    "cv-folds": "`k` >= 3: k stratified folds per client, fold `cv-fold` is test, the next one val, the rest "
    "train (`val-fraction`/`test-fraction` ignored; 004's cross-centre CV); `0`: off",
    "cv-fold": "which fold is the test fold (0 … `cv-folds` − 1)",
    "model": 'empty: the method\'s paper model ("Default model per method" below); or '
    "`resnet18`, `resnet50` (torchvision; 3×3 stem without max-pool below 48 px), `tiny-cnn`, "
    "`vit-micro` (tests), `vit-tiny`, `vit-small` (patch 8), `vit-base` (patch 16); "
    "always randomly initialised, nothing is downloaded",
    "vit-pool": "what a ViT classifier classifies: `avg` the mean of the patch tokens' outputs (MAE's "
    "fine-tuning default, 003 §III-D) or `token` the class token's output (000 §IV-A's representation); "
    '`""`: the method\'s (`token` for `fedmae`, else `avg`: "Option defaults per method" below); '
    "`token` needs a ViT `model` and one of the methods `fedmae`, `fedbeit`, `random-init`, `fedavg`, `fedprox`",
    "num-server-rounds": "federated rounds (pre-training rounds for the self-supervised methods)",
    "min-clients": "the server waits until this many clients are connected, and needs this many per round",
    "local-epochs": "epochs over the client's images per round",
    "batch-size": "local mini-batch size",
    "optimizer": "local optimiser (`sgd` uses `momentum`)",
    "lr": "learning rate of round 1 (`fedmae`/`fedbeit` pre-train with `mim.lr`)",
    "momentum": "SGD momentum",
    "weight-decay": "weight decay",
    "lr-schedule": "`cosine`: lr·½(1 + cos(π(r−1)/R)); `exponential`: lr·`lr-decay`^(r−1) (SiFT §2.4); "
    "`constant`: no decay",
    "lr-decay": 'the factor per round of `lr-schedule="exponential"`, in every stage (training and '
    "pre-training rounds, fine-tuning rounds, held-out-centre epochs)",
    "proximal-mu": 'FedProx μ (`method="fedprox"`), e.g. 0.01',
    "device": "`auto` uses CUDA when present, else CPU",
    "compile": "`true`: `torch.compile` each client model's forward once per process (pays on a GPU for "
    "long local training; the first message pays the compile time; docs/gpu.md)",
    "precision": "mixed precision of every local loop: `fp32` (off), `bf16` (autocast; CPU and CUDA) or `fp16` "
    "(autocast + GradScaler; CUDA only); weights, aggregation and the wire stay float32 (docs/gpu.md)",
    "bn-stats": "what every local loop leaves in the BatchNorm running statistics that are sent, averaged and "
    "evaluated: `round` (reset at the start of the last local epoch, then the cumulative average over its "
    "batches: they describe the client's data under the round's weights at any number of steps per round) "
    "or `ema` (PyTorch's exponential average, momentum 0.1, carried across rounds; fedderm before "
    "`bn-stats`); docs/batchnorm.md",
    "finetune": "after pre-training: `federated` (FedAvg of the classifiers), `local` (each client fine-tunes "
    "its own copy and keeps its best-on-val model) or `none` (pre-training only)",
    "finetune-rounds": "fine-tuning rounds",
    "finetune-epochs": "epochs over the labelled images per fine-tuning round",
    "augment": "augmentation of the non-contrastive stages: `flip` (h+v flips), `paper` (the method's paper: "
    "FedMAE 000, Fed-BEiT 003, FL-BT/SSL-FL-BT/FedBN/MOON 004, else `flip`), or a paper's policy "
    "`000` | `003` | `004` (docs/augmentation.md)",
    "finetune-lr": "fine-tuning learning rate (000: Adam 1e-4), under `lr-schedule`",
    "finetune-optimizer": "fine-tuning optimiser",
    "finetune-batch-size": "fine-tuning batch size; `0` = `batch-size` (003: 128 in pre-training, 256 in fine-tuning)",
    "peft": "`lora`: the fine-tuning stage freezes the backbone and trains LoRA adapters (the `peft` library) and "
    "the head; only those travel each round, the frozen backbone once (docs/methods/lora.md); `none`: every weight",
    "lora-rank": "r of the LoRA adapters (update (α/r)·B·A, B d×r, A r×k)",
    "lora-alpha": "α of the LoRA adapters (the update is scaled by α/r)",
    "lora-dropout": "dropout on the LoRA branch's input during training",
    "lora-targets": "comma-separated module names (or name suffixes) of the backbone that get adapters; empty: a ViT's "
    "attention `qkv` and `proj` layers, any other model's convolutions",
    "peft-personal": "`true`: each hospital keeps a personal LoRA adapter and the head in its client state (never "
    "sent); only the shared adapter is averaged (FedPer/FedDPA-style); evaluated per hospital",
    "init-checkpoint": "a local file to start the backbone from (a timm/torch state dict, an official MAE "
    "checkpoint, a fedderm `model.pt` or `model-pretrained.pt`), loaded strictly; methods without "
    "pre-training (`random-init`, `fedavg`, `fedprox`); nothing is downloaded",
    "holdout-centre": "a centre kept out of the federation (its `partition-id` or node-config `site`) that "
    'fine-tunes the final global model afterwards (004 Table XI); `""`: off',
    "holdout-epochs": "fine-tuning epochs on the held-out centre (its best epoch on val is tested)",
    "holdout-lr": "the held-out centre's learning rate (`optimizer`, under `lr-schedule`)",
    "output-dir": "where run folders are written (an absolute path is safest)",
    "run-name": "the run folder's name; default `<method>-<dataset>-<date>-<time>-<id>`",
    "resume": "a run folder to continue from its newest checkpoint (docs/failures.md)",
    "keep-checkpoints": "per-round checkpoints kept per stage, newest first, with the best-on-val model "
    "they name (`0` keeps all); clients keep as many steps of their state",
    "round-timeout": "seconds a round waits for replies and for `min-clients` to connect "
    "(keep it >= 15 s in simulation)",
    "targets": "comma-separated balanced accuracies: `rounds_to_target` in summary.json gives the first round "
    "whose mean val balanced accuracy reaches each (002 Table 2)",
    "transport-dtype": "`float16` sends every floating-point array as float16 (half the traffic); "
    "the server keeps and averages float32; integer buffers travel unchanged",
    "val-in-train": "`true`: FedAvg/FedProx evaluate round r's global model on val inside round r+1's train "
    "message (one exchange per round instead of two; the same metrics); `false`: a separate evaluate message",
    "tensorboard": "`true`: the server writes TensorBoard event files into the run folder (scalars per round, "
    "per client and mean; the final table as text); `tensorboard --logdir <output-dir>`",
    "aggregation": "how the server combines the screened updates: `mean` (FedAvg, weighted by `num-examples`), "
    "or one of Flower's robust rules: `median` (coordinate-wise, FedMedian), `trimmed-mean` (FedTrimmedAvg, "
    "`trimmed-mean-beta`), `krum` (the one update nearest the others), `multi-krum` (the mean of the "
    "`multi-krum-select` nearest), `bulyan`; the median, trimmed mean and Bulyan ignore `num-examples`. For the "
    "methods that average one model per reply (FedAvg, FedProx, FedBN, FL-BT, MOON, Semi-FL, the self-supervised "
    "pre-training and fine-tuning, LoRA adapters); refused for `scaffold` and `feddyn` (their server step needs the "
    'mean), `sift` (a ring, nothing averaged), `local`/`localcl` (nothing averaged) and `dp.mode = "server"` '
    "(clipping and noise calibrated to the mean); docs/security.md",
    "byzantine-clients": "f: how many bad replies a robust `aggregation` must withstand: `min-clients` must be "
    ">= 2f + 1 (`median`), 2f + 3 (`krum`, `multi-krum`), 4f + 3 (`bulyan`), and `trimmed-mean` cut at least f "
    "per side (int(`trimmed-mean-beta` x `min-clients`) >= f); checked before the run",
    "trimmed-mean-beta": '`aggregation = "trimmed-mean"`: the share of replies cut from each end of every '
    "coordinate before averaging, in [0, 0.5)",
    "multi-krum-select": '`aggregation = "multi-krum"`: how many of the best-scored updates are averaged '
    "(weighted by `num-examples`); `0`: the round's replies less `byzantine-clients`",
    "max-update-norm": "`C` > 0: a reply whose weights lie further than C (L2, over every floating-point "
    "array, BatchNorm statistics included) from the global model sent is rejected (logged, summary.json "
    '`missing_clients`); `0`: off. Rejected, not clipped: for clipping use `dp.mode = "server"`',
    "probe-every": "`k` > 0: every k pre-training rounds (and after the last) every client scores the current "
    "encoder with a cosine kNN (k = 20) and a logistic-regression probe on frozen features, trained on "
    "its labelled images, scored on val (splits `probe-knn`, `probe-linear`; self-supervised methods "
    "only; docs/probes.md); `0`: off",
    "insecure-reproducible-noise": "**insecure**, simulation only: `true` seeds the privacy noise (`dp.mode`, "
    "the FedCLF relay's noise and shuffle) from `seed`, so that anyone who knows the run config can "
    "subtract it and the reported ε does not hold; summary.json records it (`insecure`), a deployment "
    "refuses it (docs/privacy.md); `false`: the noise comes from the OS's CSPRNG",
}
