"""Masked autoencoder (He et al. 2022, "MAE") for FedMAE (paper 000 §IV) and Fed-MAE (003 §III-C).

A ViT encoder sees only the visible patches; a lightweight ViT decoder gets the encoded patches
plus a learnable mask token at every removed position and regresses the pixels of each patch.
The loss is the per-patch mean squared error, averaged over the *masked* patches only (000 Eq. 7,
003 Eq. 4).  Module and method names follow the public MAE reference, so a checkpoint saved by
it (``{"model": state_dict}``) loads with ``strict=True`` (see :func:`load_mae_checkpoint`).

Encoders come in the sizes of the registered ViT classifiers (``fedderm.models.VIT_ARCHS``:
``vit-micro`` … ``vit-base``), so that a pre-trained encoder is exactly the fine-tuning
backbone of the same name.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from timm.models.vision_transformer import Block, PatchEmbed
from torch import nn

from .config import Config, ConfigError
from .models import vit_arch

LayerNorm = partial(nn.LayerNorm, eps=1e-6)

#: ``fedmae.exclude`` presets (000 Table V): which parameters stay on each client during the
#: rounds (matched as name prefixes, trainable parameters only) and are averaged once at the end.
EXCLUDE_PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),  # "Encoder+Decoder": everything synchronised
    "decoder": ("decoder_", "mask_token"),  # "W/o Decoder"
    "patch-embed": ("patch_embed.",),  # "W/o Linear Projection" (encoder input)
    "decoder-embed": ("decoder_embed.",),  # "W/o Decoder Projection" (decoder input)
    "cls-token": ("cls_token",),  # "W/o Class Token" (FedMAE, the paper's choice)
}


# -- fixed 2-D sine-cosine position embeddings (MAE reference, util/pos_embed.py) ------------------
def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    """(M, dim) embedding of positions: [sin(p·ω_k), cos(p·ω_k)], ω_k = 10000^(−k/(dim/2))."""
    if dim % 2:
        raise ValueError(f"sine-cosine embedding needs an even dimension, got {dim}")
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2))
    angles = np.outer(positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_2d(dim: int, grid_size: int, cls_token: bool = False) -> np.ndarray:
    """(grid², dim) embedding of a square patch grid in row-major order; the first half of the
    channels encodes the column, the second half the row (the reference's convention).  With
    ``cls_token`` a zero row is prepended for the class token."""
    if dim % 4:
        raise ValueError(f"2-D sine-cosine embedding needs a dimension divisible by 4, got {dim}")
    rows, cols = np.meshgrid(np.arange(grid_size), np.arange(grid_size), indexing="ij")
    emb = np.concatenate([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], axis=1)
    if cls_token:
        emb = np.concatenate([np.zeros((1, dim)), emb], axis=0)
    return emb.astype(np.float32)


# -- patches ---------------------------------------------------------------------------------------
def patchify(imgs: torch.Tensor, p: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, L, p·p·C): patches in row-major order; inside a patch the values run
    over pixel row, then pixel column, then channel (the reference's ``nchpwq -> nhwpqc``)."""
    n, c, hh, ww = imgs.shape
    if hh != ww or hh % p:
        raise ValueError(f"patchify needs square images with a side divisible by {p}, got {hh}x{ww}")
    h = w = hh // p
    x = imgs.reshape(n, c, h, p, w, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(n, h * w, p * p * c)


def unpatchify(x: torch.Tensor, p: int, channels: int = 3) -> torch.Tensor:
    """Inverse of :func:`patchify`: (N, L, p·p·C) -> (N, C, H, W)."""
    n, length, _ = x.shape
    h = w = int(round(length**0.5))
    if h * w != length:
        raise ValueError(f"unpatchify needs a square number of patches, got {length}")
    x = x.reshape(n, h, w, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(n, channels, h * p, w * p)


def random_masking(x: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None):
    """Per-sample random masking by sorting uniform noise (small noise = kept).

    Returns the kept tokens ``(N, L_keep, D)``, the binary mask ``(N, L)`` (1 = removed) in the
    original patch order, and ``ids_restore`` that undoes the shuffle.
    """
    n, length, d = x.shape
    len_keep = int(length * (1 - mask_ratio))
    noise = torch.rand(n, length, generator=generator).to(x.device)
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]
    kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, d))
    mask = torch.ones(n, length, device=x.device)
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, 1, ids_restore)
    return kept, mask, ids_restore


def masked_patch_mse(
    target: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor, norm_pix_loss: bool = False
) -> torch.Tensor:
    """000 Eq. 7 / 003 Eq. 4: mean over masked patches of the per-patch mean squared error.

    With ``norm_pix_loss`` each target patch is normalised by its own mean and unbiased
    variance: (t − mean) / sqrt(var + 1e-6).
    """
    if norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)  # unbiased, as in the reference
        target = (target - mean) / (var + 1e-6) ** 0.5
    per_patch = ((pred - target) ** 2).mean(dim=-1)
    return (per_patch * mask).sum() / mask.sum()


class MaskedAutoencoderViT(nn.Module):
    """MAE with a ViT encoder and a lightweight ViT decoder (timm ``PatchEmbed`` and ``Block``).

    Names mirror the MAE reference: encoder ``patch_embed``, ``cls_token``, ``pos_embed`` (fixed),
    ``blocks``, ``norm``; decoder ``decoder_embed``, ``mask_token``, ``decoder_pos_embed`` (fixed),
    ``decoder_blocks``, ``decoder_norm``, ``decoder_pred``.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 1024,
        depth: int = 24,
        num_heads: int = 16,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
        norm_layer=LayerNorm,
        norm_pix_loss: bool = False,
    ):
        super().__init__()
        self.in_chans = in_chans
        # encoder
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim), requires_grad=False)
        self.blocks = nn.ModuleList(
            [
                Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                for _ in range(depth)
            ]
        )
        self.norm = norm_layer(embed_dim)
        # decoder
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(
            torch.zeros(1, num_patches + 1, decoder_embed_dim), requires_grad=False
        )
        self.decoder_blocks = nn.ModuleList(
            [
                Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                for _ in range(decoder_depth)
            ]
        )
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size**2 * in_chans, bias=True)
        self.norm_pix_loss = norm_pix_loss
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Fixed sine-cosine position embeddings; Xavier-uniform linear layers (and the patch
        projection viewed as a linear layer); N(0, 0.02) class and mask tokens."""
        grid = self.patch_embed.grid_size[0]
        self.pos_embed.data.copy_(
            torch.from_numpy(sincos_2d(self.pos_embed.shape[-1], grid, True)).unsqueeze(0)
        )
        self.decoder_pos_embed.data.copy_(
            torch.from_numpy(sincos_2d(self.decoder_pos_embed.shape[-1], grid, True)).unsqueeze(0)
        )
        w = self.patch_embed.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    @property
    def patch_size(self) -> int:
        return self.patch_embed.patch_size[0]

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        return patchify(imgs, self.patch_size)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        return unpatchify(x, self.patch_size, self.in_chans)

    def random_masking(self, x: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None):
        return random_masking(x, mask_ratio, generator)

    def forward_encoder(self, x: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None):
        """Embed patches, add position embeddings, keep a random (1 − ratio) subset, prepend the
        class token, run the blocks; returns (latent, mask, ids_restore)."""
        x = self.patch_embed(x) + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, mask_ratio, generator)
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, x: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """Project to the decoder width, put mask tokens at the removed positions (original order),
        add position embeddings, run the decoder; returns (N, L, p·p·C) patch predictions."""
        x = self.decoder_embed(x)
        n, length = ids_restore.shape
        mask_tokens = self.mask_token.expand(n, length + 1 - x.shape[1], -1)
        patches = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[2]))
        x = torch.cat([x[:, :1, :], patches], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:, :]

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked-patch MSE (000 Eq. 7) against the patchified image (see :func:`masked_patch_mse`)."""
        return masked_patch_mse(self.patchify(imgs), pred, mask, self.norm_pix_loss)

    def forward(self, imgs: torch.Tensor, mask_ratio: float = 0.75, generator: torch.Generator | None = None):
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio, generator)
        pred = self.forward_decoder(latent, ids_restore)
        return self.forward_loss(imgs, pred, mask), pred, mask


def encoder_keys(state_keys) -> list[str]:
    """The encoder's keys of an MAE/BEiT state dict (what fine-tuning keeps)."""
    return [
        k
        for k in state_keys
        if k.split(".")[0] in ("patch_embed", "cls_token", "pos_embed", "blocks", "norm")
    ]


def excluded_keys(model: nn.Module, exclude: str) -> list[str]:
    """Names of the trainable parameters that ``fedmae.exclude=exclude`` keeps on the clients."""
    if exclude not in EXCLUDE_PRESETS:
        raise ConfigError(
            f"run-config key 'fedmae.exclude' must be one of {list(EXCLUDE_PRESETS)}, got {exclude!r}"
        )
    prefixes = EXCLUDE_PRESETS[exclude]
    return [name for name, p in model.named_parameters() if p.requires_grad and name.startswith(prefixes)]


# -- the decoder's size -----------------------------------------------------------------------------
#: The MAE reference's decoder of ViT-B/16 (``mae_vit_base_patch16_dec512d8b``), with which 000 and 003
#: pre-train ViT-B/16 (003 §IV-D: 111.7M parameters with the encoder): width, blocks, heads.
PAPER_DECODER = {"fedmae.decoder-embed-dim": 512, "fedmae.decoder-depth": 8, "fedmae.decoder-num-heads": 16}
#: the width of one head of the reference's decoder (512 / 16)
DECODER_HEAD_DIM = 32


def auto_decoder(embed_dim: int, depth: int) -> tuple[int, int, int]:
    """(width, blocks, heads) of a decoder sized to an encoder of width ``embed_dim`` and ``depth``
    blocks, in the proportions of the reference's ViT-B MAE (768 × 12 encoder, 512 × 8 decoder):
    width 2/3 of the encoder's in whole 32-wide heads (at least one), blocks 2/3 of the encoder's
    (at least one), heads of 32 channels.  ViT-B gets the reference's 512 × 8 × 16 exactly; smaller
    encoders a decoder that stays about a third of the encoder's parameters (``vit-micro``: 32 × 1 × 1).
    MAE (He et al. 2022, §4.1, Table 1) found fine-tuning insensitive to the decoder's size
    (one block: 84.8 % against 84.9 % with eight)."""
    heads = max(1, (embed_dim + 24) // 48)  # round(embed_dim · 2/3 / 32)
    return DECODER_HEAD_DIM * heads, max(1, (2 * depth + 1) // 3), heads


def decoder_defaults(cfg: Config) -> dict[str, int]:
    """``Method.resolve`` of ``fedmae``: the decoder keys the run config leaves unset (``-1``), sized to
    the encoder ``cfg.model`` by :func:`auto_decoder`; the heads follow the width when only the width is
    given (the most heads of at least 32 channels that divide it in multiples of 4)."""
    arch = vit_arch(cfg.model)
    width, blocks, heads = auto_decoder(arch["embed_dim"], arch["depth"])
    given = cfg.option("fedmae.decoder-embed-dim")
    if given != -1:
        width = given
        heads = next((h for h in range(max(1, width // DECODER_HEAD_DIM), 0, -1) if width % (4 * h) == 0), 1)
    return {
        "fedmae.decoder-embed-dim": width,
        "fedmae.decoder-depth": blocks,
        "fedmae.decoder-num-heads": heads,
    }


# -- building from the run config -----------------------------------------------------------------
@dataclass(frozen=True)
class MAEOptions:
    """The ``fedmae.*`` run-config keys, validated."""

    mask_ratio: float
    exclude: str
    norm_pix_loss: bool
    decoder_embed_dim: int
    decoder_depth: int
    decoder_num_heads: int
    init_checkpoint: str
    pretrain: bool

    @classmethod
    def from_config(cls, cfg: Config) -> MAEOptions:
        o = cls(
            mask_ratio=cfg.option("fedmae.mask-ratio"),
            exclude=cfg.option("fedmae.exclude"),
            norm_pix_loss=cfg.option("fedmae.norm-pix-loss"),
            decoder_embed_dim=cfg.option("fedmae.decoder-embed-dim"),
            decoder_depth=cfg.option("fedmae.decoder-depth"),
            decoder_num_heads=cfg.option("fedmae.decoder-num-heads"),
            init_checkpoint=cfg.option("fedmae.init-checkpoint"),
            pretrain=cfg.option("fedmae.pretrain"),
        )
        if not 0 < o.mask_ratio < 1:
            raise ConfigError(f"run-config key 'fedmae.mask-ratio' must be in (0, 1), got {o.mask_ratio}")
        if o.exclude not in EXCLUDE_PRESETS:
            raise ConfigError(
                f"run-config key 'fedmae.exclude' must be one of {list(EXCLUDE_PRESETS)}, got {o.exclude!r}"
            )
        if o.decoder_depth < 1 or o.decoder_num_heads < 1 or o.decoder_embed_dim % (4 * o.decoder_num_heads):
            raise ConfigError(
                "run-config keys 'fedmae.decoder-embed-dim' / 'fedmae.decoder-num-heads' / "
                "'fedmae.decoder-depth': the depth and heads must be >= 1 and the width a multiple "
                f"of 4 x heads, got {o.decoder_embed_dim} / {o.decoder_num_heads} / {o.decoder_depth}"
            )
        if o.init_checkpoint and not Path(o.init_checkpoint).expanduser().is_file():
            raise ConfigError(f"run-config key 'fedmae.init-checkpoint': no such file {o.init_checkpoint!r}")
        return o


def encoder_arch(cfg: Config) -> dict[str, int]:
    """Sizes of the ViT ``cfg.model`` (the encoder of MAE and BEiT), checked against ``image-size``."""
    try:
        arch = vit_arch(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.image_size % arch["patch_size"]:
        raise ConfigError(
            f"run-config key 'image-size' ({cfg.image_size}) must be a multiple of the patch size "
            f"{arch['patch_size']} of model {cfg.model!r}"
        )
    return arch


def build_mae(cfg: Config) -> MaskedAutoencoderViT:
    """The MAE whose encoder is the ViT ``cfg.model`` at ``cfg.image_size``, decoder per ``fedmae.*``."""
    o = MAEOptions.from_config(cfg)
    arch = encoder_arch(cfg)
    return MaskedAutoencoderViT(
        img_size=cfg.image_size,
        decoder_embed_dim=o.decoder_embed_dim,
        decoder_depth=o.decoder_depth,
        decoder_num_heads=o.decoder_num_heads,
        norm_pix_loss=o.norm_pix_loss,
        **arch,
    )


# -- checkpoints --------------------------------------------------------------------------------
def _resize_pos_embed(pos: torch.Tensor, num_patches: int) -> torch.Tensor:
    """Bicubic resize of the patch part of a (1, 1 + L, D) position embedding to ``num_patches``
    (what the MAE reference does when fine-tuning at another resolution)."""
    old, new = int(round((pos.shape[1] - 1) ** 0.5)), int(round(num_patches**0.5))
    grid = pos[:, 1:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = nn.functional.interpolate(grid.float(), size=(new, new), mode="bicubic", align_corners=False)
    return torch.cat([pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, new * new, -1)], dim=1)


def load_mae_checkpoint(model: MaskedAutoencoderViT, path: str | Path) -> list[str]:
    """Load an official-format MAE checkpoint (a file holding ``{"model": state_dict}`` with the
    reference's names) with ``strict=True``; returns the keys loaded.

    A full checkpoint (encoder + decoder) must match the whole model; an encoder-only
    checkpoint (like the released ``mae_pretrain_vit_*.pth``) must match the encoder exactly
    and leaves the decoder as initialised.  Position embeddings of another patch grid are
    resized bicubically; any other missing, unexpected or mis-shaped key is an error naming it.
    """
    path = Path(path).expanduser()
    # checkpoints written by the reference's training script also hold its argparse ``args``
    with torch.serialization.safe_globals([argparse.Namespace]):
        obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise ValueError(
            f"{path}: expected an MAE checkpoint, a dict with key 'model' holding the state dict; "
            f"found {type(obj).__name__} with keys {list(obj)[:8] if isinstance(obj, dict) else []}"
        )
    state = dict(obj["model"])
    own = model.state_dict()
    for key in ("pos_embed", "decoder_pos_embed"):
        if key in state and state[key].shape != own[key].shape and state[key].shape[-1] == own[key].shape[-1]:
            state[key] = _resize_pos_embed(state[key], own[key].shape[1] - 1)
    expected = set(own) if any(k.startswith("decoder_") for k in state) else set(encoder_keys(own))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    mis_shaped = sorted(k for k in expected & set(state) if tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or mis_shaped:
        raise ValueError(
            f"{path}: checkpoint does not match the {len(expected)}-key MAE "
            f"({'encoder+decoder' if len(expected) == len(own) else 'encoder'}): "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}, mis-shaped {mis_shaped[:8]}"
            + _decoder_hint(state, own, [*missing, *unexpected, *mis_shaped])
        )
    if expected == set(own):
        model.load_state_dict(state, strict=True)
    else:  # encoder-only: strict over the encoder (checked above), decoder kept
        model.load_state_dict({**own, **state}, strict=True)
    return sorted(state)


def _decoder_size(state) -> tuple[int, int]:
    """(width, blocks) of the decoder in an MAE state dict."""
    blocks = {k.split(".")[1] for k in state if k.startswith("decoder_blocks.")}
    return int(state["decoder_embed.weight"].shape[0]), len(blocks)


def _decoder_hint(state, own, problems: list[str]) -> str:
    """What to set when a full checkpoint's decoder is not the run's (the run's may be sized to its encoder)."""
    if "decoder_embed.weight" not in state or not any(
        k.startswith(("decoder_", "mask_token")) for k in problems
    ):
        return ""
    (width, blocks), (run_width, run_blocks) = _decoder_size(state), _decoder_size(own)
    return (
        f"; its decoder is {width} wide x {blocks} blocks, this run's {run_width} x {run_blocks}: set "
        f"fedmae.decoder-embed-dim={width} fedmae.decoder-depth={blocks} and fedmae.decoder-num-heads as it was "
        "trained (the MAE reference's: 16) to load it whole"
    )


# -- transfer to the fine-tuning classifier ----------------------------------------------------------
def vit_backbone_state(ssl_state: dict[str, torch.Tensor], target_keys) -> dict[str, torch.Tensor]:
    """Map a pre-trained MAE/BEiT encoder onto a timm ``VisionTransformer`` backbone with keys
    ``target_keys``: ``patch_embed``, ``cls_token``, ``pos_embed`` (class-token row first, as in
    timm) and ``blocks`` carry over by name.  The encoder's final ``norm`` goes to timm's ``norm``
    for class-token pooling; with average pooling timm has ``fc_norm`` after the pooling instead,
    which starts fresh (ones/zeros), exactly as the MAE reference fine-tunes with global pooling.
    """
    target_keys = set(target_keys)
    out = {k: ssl_state[k] for k in encoder_keys(ssl_state) if k in target_keys}
    if "norm.weight" not in target_keys and "fc_norm.weight" in target_keys:
        d = ssl_state["norm.weight"].shape[0]
        out["fc_norm.weight"], out["fc_norm.bias"] = torch.ones(d), torch.zeros(d)
    return out
