"""BEiT-style masked visual-token prediction (Bao et al. 2022) for Fed-BEiT (paper 003 §III-C).

Block-wise masked patches are replaced by a learnable ``mask_token`` at the ViT input; a linear
``lm_head`` on the encoder output predicts, at every masked position, the visual token of that
patch; the loss is the mean cross-entropy over the masked positions (003 Eq. 3).

The paper's tokenizer is the DALL-E dVAE, which cannot be downloaded here.  Two tokenizers:

* ``fedbeit.tokenizer = ""`` (default): :class:`RandomProjectionTokenizer`, a *substitute*, not
  the dVAE.  Each patch's pixels (normalised to [−1, 1], in :func:`fedderm.mae.patchify` order)
  are multiplied by a fixed Gaussian random matrix (patch values -> 16 dims), L2-normalised,
  and assigned the index of the nearest of ``vocab-size`` fixed random unit codewords (the
  random-projection quantiser of BEST-RQ, Chiu et al. 2022).  Matrix and codebook are drawn
  from the run's ``seed``, so every client has the *same* tokenizer without fitting on or
  sharing any data (a codebook fitted on each client's own images would give each client a
  different vocabulary, and FedAvg of ``lm_head`` would average unrelated classes).
* ``fedbeit.tokenizer = "/path/tok.pt"``: a user-supplied TorchScript module (for instance the
  DALL-E encoder with its resizing and pixel mapping, traced with ``torch.jit.trace``).  It
  gets images as float (N, 3, H, W) in [0, 1] at ``image-size`` and returns token ids
  (N, h, w) or (N, h·w), or logits (N, vocab, h, w); h × w must be the ViT's patch grid and
  ids must be below ``fedbeit.vocab-size``.

BEiT's relative position bias and layer scale are left out: the encoder keeps the names and
layout of the timm ``VisionTransformer`` fine-tuning backbone (learned absolute ``pos_embed``),
and starts from the MAE encoder's initialisation (:meth:`BEiTPretrainViT.initialize_weights`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block, PatchEmbed
from torch import nn

from .config import Config, ConfigError
from .mae import LayerNorm, MaskedAutoencoderViT, encoder_arch, patchify, sincos_2d
from .models import vit_arch


# -- block-wise masking (BEiT's masking generator) -------------------------------------------------
def block_mask(
    height: int,
    width: int,
    num_masking_patches: int,
    rng: np.random.Generator,
    min_num_patches: int = 16,
    max_num_patches: int | None = None,
    min_aspect: float = 0.3,
) -> np.ndarray:
    """A (height, width) bool mask of about ``num_masking_patches`` patches (never more), made
    of rectangular blocks: each block has an area uniform in [min, max] patches and a log-uniform
    aspect ratio in [min_aspect, 1/min_aspect]; up to 10 tries per block, and masking stops when
    the target is reached or a block adds nothing.  ``min_num_patches`` is capped at the target,
    so that small grids (e.g. 4 × 4) can be masked."""
    mask = np.zeros((height, width), dtype=bool)
    max_num_patches = num_masking_patches if max_num_patches is None else max_num_patches
    min_num_patches = min(min_num_patches, num_masking_patches)
    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    count = 0
    while count < num_masking_patches:
        budget = min(num_masking_patches - count, max_num_patches)
        delta = 0
        for _ in range(10):
            area = rng.uniform(min_num_patches, budget) if budget > min_num_patches else float(budget)
            aspect = math.exp(rng.uniform(*log_aspect))
            h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if 0 < h < height and 0 < w < width:
                top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
                block = mask[top : top + h, left : left + w]
                new = h * w - int(block.sum())
                if 0 < new <= budget:
                    block[...] = True
                    delta = new
                    break
        if delta == 0:
            break
        count += delta
    return mask


# -- tokenizers --------------------------------------------------------------------------------------
class RandomProjectionTokenizer(nn.Module):
    """Fixed random-projection quantiser (the offline substitute for the DALL-E dVAE; module
    docstring).  ``forward(imgs in [−1, 1]) -> (N, L)`` token ids."""

    def __init__(self, patch_size: int, vocab_size: int, seed: int, in_chans: int = 3, code_dim: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.patch_size, self.vocab_size = patch_size, vocab_size
        self.register_buffer(
            "projection", torch.randn(patch_size * patch_size * in_chans, code_dim, generator=g)
        )
        self.register_buffer("codebook", F.normalize(torch.randn(vocab_size, code_dim, generator=g), dim=1))

    @torch.no_grad()
    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        codes = F.normalize(patchify(imgs, self.patch_size) @ self.projection, dim=-1)
        return (codes @ self.codebook.T).argmax(dim=-1)  # nearest unit codeword = largest cosine


class ScriptedTokenizer(nn.Module):
    """A user-supplied TorchScript tokenizer (contract in the module docstring)."""

    def __init__(self, path: str | Path, vocab_size: int, grid: int):
        super().__init__()
        self.path = Path(path).expanduser()
        try:
            self.module = torch.jit.load(str(self.path), map_location="cpu")
        except Exception as err:  # noqa: BLE001 - name the file whatever went wrong
            raise ValueError(
                f"fedbeit.tokenizer {str(self.path)!r}: cannot load a TorchScript module "
                f"({type(err).__name__}: {err})"
            ) from err
        self.module.eval()
        self.vocab_size, self.grid = vocab_size, grid

    @torch.no_grad()
    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        out = self.module((imgs + 1) / 2)  # [-1, 1] -> [0, 1]
        if out.is_floating_point():
            if out.dim() != 4:
                raise ValueError(
                    f"fedbeit.tokenizer {str(self.path)!r}: float output must be logits "
                    f"(N, vocab, h, w), got shape {tuple(out.shape)}"
                )
            out = out.argmax(dim=1)
        ids = out.reshape(out.shape[0], -1).long()
        if ids.shape[1] != self.grid**2:
            raise ValueError(
                f"fedbeit.tokenizer {str(self.path)!r}: gives {ids.shape[1]} tokens per image; "
                f"the ViT has a {self.grid}x{self.grid} patch grid"
            )
        if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise ValueError(
                f"fedbeit.tokenizer {str(self.path)!r}: token id {int(ids.max())} outside "
                f"[0, fedbeit.vocab-size={self.vocab_size})"
            )
        return ids


# -- the model -----------------------------------------------------------------------------------------
class BEiTPretrainViT(nn.Module):
    """ViT for masked image modelling (BEiT names: ``patch_embed``, ``cls_token``, ``mask_token``,
    ``pos_embed``, ``blocks``, ``norm``, ``lm_head``)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        vocab_size: int = 8192,
        mlp_ratio: float = 4.0,
        norm_layer=LayerNorm,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.blocks = nn.ModuleList(
            [
                Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                for _ in range(depth)
            ]
        )
        self.norm = norm_layer(embed_dim)
        self.lm_head = nn.Linear(embed_dim, vocab_size)
        self.initialize_weights(init_std)

    def initialize_weights(self, init_std: float = 0.02) -> None:
        """The MAE encoder's initialisation (:meth:`fedderm.mae.MaskedAutoencoderViT.initialize_weights`,
        the one the "ViT from scratch" rows of 003 Table III fine-tune from): ``pos_embed`` starts at the
        2-D sine-cosine embedding (learned here, the stand-in for BEiT's relative position bias, which
        knows relative offsets from the first step), Xavier-uniform linear layers and patch projection;
        ``cls_token`` / ``mask_token`` truncated normal (std ``init_std``), as in BEiT.

        BEiT's own scheme (every weight N(0, 0.02) truncated at ±1 std, output projections divided
        by √(2·layer)) is calibrated to ViT-B's width 768; at vit-micro's width 64 its weights are
        about 8× smaller than Xavier's, the encoder's features barely separate the classes and
        fine-tuning from it is far worse than from the scratch rows' MAE initialisation (
        docs/methods/fedmae-fedbeit.md, "Fed-BEiT below the ViT from scratch")."""
        pos = sincos_2d(self.pos_embed.shape[-1], self.grid, cls_token=True)
        self.pos_embed.data.copy_(torch.from_numpy(pos).unsqueeze(0))
        w = self.patch_embed.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.proj.bias)
        for p in (self.cls_token, self.mask_token):
            nn.init.trunc_normal_(p, std=init_std, a=-init_std, b=init_std)
        self.apply(MaskedAutoencoderViT._init_weights)

    @property
    def grid(self) -> int:
        return self.patch_embed.grid_size[0]

    def forward_features(self, x: torch.Tensor, bool_masked_pos: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        w = bool_masked_pos.unsqueeze(-1).type_as(x)
        x = x * (1 - w) + self.mask_token.expand_as(x) * w
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor, bool_masked_pos: torch.Tensor) -> torch.Tensor:
        """Visual-token logits at the masked positions, (num_masked, vocab)."""
        return self.lm_head(self.forward_features(x, bool_masked_pos)[:, 1:][bool_masked_pos])


def masked_token_loss(
    logits: torch.Tensor, tokens: torch.Tensor, bool_masked_pos: torch.Tensor
) -> torch.Tensor:
    """003 Eq. 3: −(1/|M|) Σ_{i∈M} log p(z_i | x^M), the cross-entropy at the masked positions."""
    return F.cross_entropy(logits, tokens[bool_masked_pos])


# -- building from the run config -----------------------------------------------------------------
@dataclass(frozen=True)
class BEiTOptions:
    """The ``fedbeit.*`` run-config keys, validated."""

    mask_ratio: float
    vocab_size: int
    tokenizer: str

    @classmethod
    def from_config(cls, cfg: Config) -> BEiTOptions:
        o = cls(
            cfg.option("fedbeit.mask-ratio"),
            cfg.option("fedbeit.vocab-size"),
            cfg.option("fedbeit.tokenizer"),
        )
        if not 0 < o.mask_ratio < 1:
            raise ConfigError(f"run-config key 'fedbeit.mask-ratio' must be in (0, 1), got {o.mask_ratio}")
        if o.vocab_size < 2:
            raise ConfigError(f"run-config key 'fedbeit.vocab-size' must be >= 2, got {o.vocab_size}")
        if o.tokenizer and not Path(o.tokenizer).expanduser().is_file():
            raise ConfigError(f"run-config key 'fedbeit.tokenizer': no such file {o.tokenizer!r}")
        return o


def build_beit(cfg: Config) -> BEiTPretrainViT:
    """The BEiT pre-training ViT whose encoder is the ViT ``cfg.model`` at ``cfg.image_size``."""
    o = BEiTOptions.from_config(cfg)
    arch = encoder_arch(cfg)
    return BEiTPretrainViT(img_size=cfg.image_size, vocab_size=o.vocab_size, **arch)


def build_tokenizer(cfg: Config) -> nn.Module:
    """``fedbeit.tokenizer``'s TorchScript module, or the seeded random-projection substitute."""
    o = BEiTOptions.from_config(cfg)
    arch = vit_arch(cfg.model)
    if o.tokenizer:
        return ScriptedTokenizer(o.tokenizer, o.vocab_size, cfg.image_size // arch["patch_size"])
    return RandomProjectionTokenizer(arch["patch_size"], o.vocab_size, seed=cfg.seed * 7919 + 17)


def num_masking_patches(grid: int, mask_ratio: float) -> int:
    return max(1, int(round(mask_ratio * grid * grid)))


def beit_loss(
    model: BEiTPretrainViT, tokenizer: nn.Module, x: torch.Tensor, mask_ratio: float, rng: np.random.Generator
) -> torch.Tensor:
    """Block-mask every image of the (normalised) batch ``x``, predict the masked visual tokens."""
    grid = model.grid
    target = num_masking_patches(grid, mask_ratio)
    masks = np.stack([block_mask(grid, grid, target, rng).reshape(-1) for _ in range(x.shape[0])])
    bool_masked_pos = torch.from_numpy(masks).to(x.device)
    tokens = tokenizer(x).to(x.device)
    return masked_token_loss(model(x, bool_masked_pos), tokens, bool_masked_pos)
