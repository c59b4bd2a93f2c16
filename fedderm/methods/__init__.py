"""Each method's specification, one module per method: ``fedderm/methods/<m>.py`` registers its
:class:`Method` (name, strategy and client modules, options with defaults, checks, record keys,
paper model) with :func:`register_method`, beside the option groups and checks that only it owns.

Importing this package imports every module in it (found on disk, in name order), so a new
``fedderm/methods/<m>.py`` is registered without an edit anywhere else.  The modules import only this
package, each other and :mod:`fedderm.config`: no torch, no Flower, so a run config is checked
in a fraction of a second (``sim.py``).  :mod:`registry` looks methods up and checks a run config
against all of them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedderm.config import METHOD_KEYS, Config, ConfigError


@dataclass(frozen=True)
class Method:
    """A method of the product.

    ``strategy``/``client`` are module paths: the strategy module has ``build_strategy(cfg)``
    (and optionally its own ``run``), the client module a ``HANDLERS`` dict from message type
    (``train``, ``evaluate``, …) to handler.  ``options`` are the method's namespaced run-config
    keys with their defaults.  ``sends`` are the record keys its client replies may hold (what the
    outgoing audit checks).  ``check(cfg)`` (optional) validates the values of its options, raising
    ``ConfigError``.  ``messages`` are the message types its client handles; types with an action
    (``train.gan``) are registered on the ClientApp from here.
    ``network`` is what its final global model (``model.pt``) is, for fine-tuning on a held-out
    centre (``holdout-centre``): ``classifier`` (``create_model(model)``), ``projected`` (the 004
    network of :mod:`fedderm.flbt`), or ``""`` (not supported).
    ``smallest`` are the settings its smallest run needs on top of ``registry.SMALLEST_RUN`` (a ViT,
    a short GAN stage): see ``registry.smallest_run``.
    ``model`` is its paper's model, taken when the run config leaves ``model`` unset (``""``);
    ``models`` the models it can train (empty: any registered model); ``paper_image_size`` the
    paper's image size (documentation: ``image-size`` keeps its own default).
    ``probe`` (self-supervised methods only) names the function ``"module:function"`` that maps
    its pre-training model's state dict to ``cfg.model``'s backbone, for the encoder probes of
    ``probe-every`` (:mod:`fedderm.probes`); ``""``: the method has no encoder to probe.
    ``augment`` is the paper whose augmentation policy ``augment="paper"`` picks
    (:data:`fedderm.augment.POLICIES`; ``flip`` where its paper gives none).
    ``defaults`` are its paper's values of option keys that are declared unset (:data:`UNSET`:
    ``""``, ``-1``), and of the core keys whose default is the method's
    (:data:`fedderm.config.METHOD_KEYS`: ``vit-pool``), taken when the run config leaves them unset,
    as ``model`` is for ``model``; a value set in the run config wins (``registry.resolve_defaults``).
    ``resolve`` (optional) names the function ``"module:function"`` that gives the option keys
    whose paper value depends on the rest of the resolved run config, ``f(cfg)`` returning
    ``{key: value}``; it is applied after ``defaults``, to the keys still unset (FedMAE's decoder,
    sized to its encoder: :func:`fedderm.mae.decoder_defaults`).
    ``data_check`` (optional) names the function ``"module:function"`` that checks its options
    against the clients' data before a simulation starts, ``f(cfg, clients)`` raising
    ``ConfigError`` (``sim.py``; SiFT's class texts against the class list).
    ``rebuild`` (optional) names the function ``"module:function"`` that rebuilds the model of its
    ``model.pt`` from the file's state dict and metadata, ``f(state, meta)`` returning the loaded
    module, for a network that is no ``create_model`` classifier (SiFT's text-guided head):
    :func:`fedderm.inference.load_model`.
    ``docs`` holds one line per option key: its meaning, for the generated run-config reference
    (docs/run-config.md; the core keys' lines are :data:`fedderm.config.KEY_DOCS`).
    ``peft``: its fine-tuning stage is the shared one of ``strategies/finetune.py`` with one global
    backbone, so ``peft="lora"`` applies (``strategies/peft.py``).  ``init_checkpoint``: its run
    starts from a classifier, so ``init-checkpoint`` applies.  ``vit_pool``: its classifier is
    built by ``fedderm.models.create_classifier`` and follows ``vit-pool``.
    """

    name: str
    strategy: str
    client: str
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)
    sends: tuple[str, ...] = ("arrays", "metrics")
    check: Callable[[Config], None] | None = None
    messages: tuple[str, ...] = ("train", "evaluate")
    network: str = "classifier"
    smallest: Mapping[str, Any] = field(default_factory=dict)
    model: str = "resnet18"
    models: tuple[str, ...] = ()
    paper_image_size: int = 0
    probe: str = ""
    augment: str = "flip"
    defaults: Mapping[str, Any] = field(default_factory=dict)
    peft: bool = False
    init_checkpoint: bool = False
    vit_pool: bool = False
    docs: Mapping[str, str] = field(default_factory=dict)
    data_check: str = ""
    rebuild: str = ""
    resolve: str = ""


#: Every registered method by name: the modules of this package, then whatever a caller registers
#: (a test's toy method).
METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` and return it.  A name already taken, an option without
    its one line in ``docs`` (or a line for no option), an option key another method declares
    with a different default, or a ``defaults`` entry for a key that is neither its option nor a
    core key it may set (:data:`fedderm.config.METHOD_KEYS`, with one of the key's values), is a
    ValueError naming them."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is registered twice")
    for key, value in method.defaults.items():
        if key in METHOD_KEYS:
            if value not in METHOD_KEYS[key]:
                raise ValueError(
                    f"method {method.name!r}: defaults[{key!r}] = {value!r} is none of {list(METHOD_KEYS[key])}"
                )
        elif key not in method.options:
            raise ValueError(
                f"method {method.name!r}: defaults names {key!r}, which is neither one of its options nor "
                f"a core key a method may set ({', '.join(METHOD_KEYS)})"
            )
    undocumented = [k for k in method.options if not str(method.docs.get(k, "")).strip()]
    stray = [k for k in method.docs if k not in method.options]
    if undocumented or stray:
        raise ValueError(
            f"method {method.name!r}: every option needs one line in Method.docs and every line an "
            f"option; without a line: {undocumented}, lines for no option: {stray}"
        )
    for other in METHODS.values():
        for key, value in method.options.items():
            if key in other.options and other.options[key] != value:
                raise ValueError(
                    f"method {method.name!r} declares option {key!r} = {value!r}, but method "
                    f"{other.name!r} declares it = {other.options[key]!r}: one key, one default"
                )
    METHODS[method.name] = method
    return method


def need(cfg: Config, ok: bool, key: str, what: str) -> None:
    """Raise ``ConfigError`` naming ``key`` and its value unless ``ok``."""
    if not ok:
        raise ConfigError(f"run-config key {key!r} {what}, got {cfg.option(key)!r}")


def mean_only(cfg: Config, method: str, why: str) -> None:
    """For ``method``'s ``check``: refuse a robust ``aggregation`` (one of Flower's rules in place of
    the mean), saying ``why`` the method's server step cannot take one."""
    if cfg.method == method and cfg.aggregation != "mean":
        raise ConfigError(
            f"run-config key 'aggregation' = {cfg.aggregation!r} does not apply to method {method!r}: "
            f'{why}; set aggregation = "mean" (robust rules fit the methods that average one model '
            "per reply: docs/security.md)"
        )


#: The declared value of an option key that means "unset: the method's paper default" (``Method.defaults``).
UNSET = ("", -1)
#: the ViTs that the ViT methods (FedMAE, Fed-BEiT, FedMoCo-v3) can pre-train
VIT_MODELS = ("vit-micro", "vit-tiny", "vit-small", "vit-base")
#: the smallest run of a ViT method (on top of ``registry.SMALLEST_RUN``)
SMALL_VIT = {"model": "vit-micro", "image-size": 16}
#: ``Method.probe`` of the self-supervised methods (fedderm.probes)
PREFIX_PROBE, VIT_PROBE = "fedderm.probes:backbone_from_prefix", "fedderm.probes:backbone_from_vit"


def _register_modules() -> None:
    """Import every module of this package (each registers its method); :data:`METHODS` is then
    in name order, whichever module imported another's option group first."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        importlib.import_module(f"{__name__}.{info.name}")
    ordered = sorted(METHODS.items())
    METHODS.clear()
    METHODS.update(ordered)


_register_modules()
