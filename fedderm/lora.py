"""Parameter-efficient fine-tuning: LoRA adapters on a frozen backbone (run-config ``peft="lora"``),
and a backbone started from a local file (``init-checkpoint``).  Pure PyTorch + the ``peft`` library.

LoRA (Hu et al. 2022, Eq. 3): a frozen weight ``W0`` (d×k) gets a trainable low-rank update,
``h = W0 x + (α/r) B A x`` with ``A`` (r×k, Kaiming-uniform) and ``B`` (d×r, zeros), so training
starts from the pre-trained model exactly.  :func:`add_lora` injects the adapters with peft's
``inject_adapter_in_model`` into the classifier's backbone, freezes every backbone tensor and
leaves the adapters and the classification head trainable; only those travel in federated
fine-tuning (``strategies/peft.py``, ``clients/peft.py``).

With ``personal`` (``peft-personal = true``) every target layer gets a second adapter,
``personal``, active together with the shared one (the sum of both updates, as the dual
personalised adapters of FedDPA, Yang et al. 2024): the shared adapter is averaged by FedAvg, the
personal adapter and the head stay on their hospital (FedPer/FedRep's split of a shared
representation and a personal head, Arivazhagan et al. 2019, Collins et al. 2021).

A frozen BatchNorm keeps its running statistics: :class:`FrozenNormClassifier` holds every
BatchNorm of the backbone in eval mode also while the model trains, so the frozen backbone is
bitwise unchanged by local training.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import nn

SHARED, PERSONAL = "default", "personal"  # peft adapter names
_VIT_DEFAULT = ("attn.qkv", "attn.proj")  # LoRA on attention (Hu et al. 2022 §7.1 adapt W_q, W_v)


class FrozenNormClassifier(nn.Module):
    """The classifier's ``backbone`` and ``head`` (same state-dict keys), whose ``train()`` keeps the
    backbone's BatchNorm layers in eval mode: frozen weights and frozen running statistics."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.backbone, self.head = classifier.backbone, classifier.head
        self.num_features = classifier.num_features

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self.backbone.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        return self


def default_targets(backbone: nn.Module) -> list[str]:
    """The layers LoRA adapts when ``lora-targets`` is empty: a ViT's attention ``qkv`` and ``proj``
    linear layers; any other network's convolutions (peft's Conv2d LoRA)."""
    names = [n for n, m in backbone.named_modules() if isinstance(m, nn.Linear) and n.endswith(_VIT_DEFAULT)]
    if names:
        return names
    return [n for n, m in backbone.named_modules() if isinstance(m, nn.Conv2d)]


def target_list(backbone: nn.Module, targets: str) -> list[str]:
    """``lora-targets`` (comma-separated module names or name suffixes, peft's matching) or the
    default; raises naming the key when an entry matches no module of the backbone."""
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    if not wanted:
        return default_targets(backbone)
    names = [n for n, _ in backbone.named_modules() if n]
    for t in wanted:
        if not any(n == t or n.endswith("." + t) for n in names):
            raise ValueError(
                f"run-config key 'lora-targets': {t!r} matches no module of the backbone "
                f"(e.g. {', '.join(names[:6])}, ...)"
            )
    return wanted


def add_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: str = "",
    personal: bool = False,
    seed: int = 0,
) -> FrozenNormClassifier:
    """``model`` (a fedderm classifier with ``backbone`` and ``head``) with LoRA adapters in its
    backbone: backbone frozen, adapters and head trainable.  The adapters' initial values are
    seeded by ``seed`` (same seed, same model).  ``personal``: a second, personal adapter per layer."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    backbone = model.backbone
    for p in backbone.parameters():
        p.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_list(backbone, targets),
        bias="none",
    )
    torch.manual_seed(seed)
    inject_adapter_in_model(config, backbone, adapter_name=SHARED)
    if personal:
        with warnings.catch_warnings():  # "multiple adapters in the model": two are meant here
            warnings.simplefilter("ignore", UserWarning)
            inject_adapter_in_model(config, backbone, adapter_name=PERSONAL)
    active = [SHARED, PERSONAL] if personal else [SHARED]
    for module in backbone.modules():
        if isinstance(module, LoraLayer):
            module.set_adapter(active)  # both adapters active and trainable (their updates add up)
    for p in model.head.parameters():
        p.requires_grad_(True)
    return FrozenNormClassifier(model)


def trainable_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the trainable tensors (adapters and head), in state-dict order."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return [k for k in model.state_dict() if k in names]


def split_keys(model: nn.Module, personal: bool) -> dict[str, list[str]]:
    """The model's state-dict keys by where they live: ``frozen`` (backbone, sent once), ``shared``
    (averaged every round) and ``personal`` (kept on each hospital; empty unless ``personal``)."""
    train = trainable_keys(model)
    own = [k for k in train if f".{PERSONAL}." in k or k.startswith("head.")] if personal else []
    return {
        "frozen": [k for k in model.state_dict() if k not in set(train)],
        "shared": [k for k in train if k not in set(own)],
        "personal": own,
    }


def part(model: nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``keys`` (detached, on the CPU)."""
    state = model.state_dict()
    return {k: state[k].detach().cpu() for k in keys}


def load_part(model: nn.Module, state: dict[str, torch.Tensor], keys: list[str], what: str) -> None:
    """Load ``state`` into ``model``: its keys must be exactly ``keys`` (else a one-line error
    naming the first missing or extra key)."""
    missing = [k for k in keys if k not in state]
    extra = [k for k in state if k not in set(keys)]
    if missing or extra:
        bad = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise ValueError(f"{what}: {bad} ({len(state)} tensors, expected {len(keys)})")
    model.load_state_dict(state, strict=False)


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain classifier's state dict (``create_model``'s keys) with every active adapter merged
    into its layer, ``W = W0 + (α/r) B A`` (Hu et al. 2022 §4.1: no inference latency): what
    ``model.pt`` holds, so that :mod:`fedderm.inference` loads it as any other classifier."""
    from peft.tuners.lora import LoraLayer

    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = f"{name}.base_layer.weight"
        with torch.no_grad():
            for adapter in module.active_adapters:
                state[key] = state[key] + module.get_delta_weight(adapter).detach().cpu()
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value
    return out


def count(state_or_model, keys: list[str] | None = None) -> int:
    """Number of elements of a state dict's (or a model's) tensors (``keys`` only, if given)."""
    state = state_or_model.state_dict() if isinstance(state_or_model, nn.Module) else state_or_model
    return int(sum(state[k].numel() for k in (keys if keys is not None else state)))


# -- init-checkpoint ---------------------------------------------------------------------------------
_HEAD_KEYS = ("head.weight", "head.bias", "fc.weight", "fc.bias")


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path``: a plain state dict, an official MAE checkpoint
    (``{"model": state_dict, ...}``) or ``{"state_dict": ...}``; loaded with ``weights_only``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"run-config key 'init-checkpoint': no file {str(path)!r}")
    with torch.serialization.safe_globals([argparse.Namespace]):
        obj = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"run-config key 'init-checkpoint': {path} holds no state dict of tensors")
    return dict(obj)


def backbone_candidates(state: dict[str, torch.Tensor], target_keys: list[str]):
    """The ways a checkpoint may name a backbone, most specific first: a fedderm classifier or
    SSL model (``backbone.*``), an MAE/BEiT encoder (mapped as for fine-tuning), the backbone's own
    keys (timm/torchvision, their classification head left out)."""
    if any(k.startswith("backbone.") for k in state):
        yield {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    if "norm.weight" in state and "patch_embed.proj.weight" in state and "fc_norm.weight" in target_keys:
        from .mae import vit_backbone_state

        yield vit_backbone_state(state, target_keys=target_keys)
    yield {k: v for k, v in state.items() if k not in _HEAD_KEYS}


def load_init_checkpoint(model: nn.Module, path: str | Path) -> str:
    """Load ``init-checkpoint`` into ``model``'s backbone, strictly: every backbone key present with
    its shape, nothing else (a one-line error names the first mismatched key).  A head in the file
    (``head.*``, a fedderm classifier's) is loaded when its shapes fit, else the model keeps its
    freshly initialised head.  Returns what was done, for the log."""
    state = read_checkpoint(path)
    own = model.backbone.state_dict()
    target = list(own)
    best, problems = None, []
    for candidate in backbone_candidates(state, target):
        problems.append(_mismatch(candidate, own))
        if not problems[-1]:
            best = candidate
            break
    if best is None:  # the problem of the most specific reading of the file
        raise ValueError(f"run-config key 'init-checkpoint': {path}: {problems[0]}")
    model.backbone.load_state_dict(best, strict=True)
    head = {k[len("head.") :]: v for k, v in state.items() if k.startswith("head.")}
    own_head = model.head.state_dict()
    if head and set(head) == set(own_head) and all(head[k].shape == own_head[k].shape for k in head):
        model.head.load_state_dict(head, strict=True)
        return f"backbone ({len(best)} tensors) and head from {path}"
    why = "its head has other shapes" if head else "it has no fedderm head"
    return f"backbone ({len(best)} tensors) from {path}; head re-initialised ({why})"


def _mismatch(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str:
    for key, value in own.items():
        if key not in state:
            return f"missing key {key!r} (the backbone has {len(own)} tensors, the file {len(state)})"
        if tuple(state[key].shape) != tuple(value.shape):
            return f"key {key!r} has shape {list(state[key].shape)}, the backbone's is {list(value.shape)}"
    extra = [k for k in state if k not in own]
    if extra:
        return f"unexpected key {extra[0]!r} (not in the backbone)"
    return ""
