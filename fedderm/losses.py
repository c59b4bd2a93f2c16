"""Losses contributed by the papers (pure PyTorch).

* :func:`barlow_twins` -- FL-BT's model-contrastive term, Eq. 5-6 of paper 004, and the original
  Barlow Twins normalisation (Zbontar et al. 2021).
* :func:`moon_contrastive` / :func:`moon_from_cosines` -- MOON's model-contrastive term
  (Li, He & Song 2021, Eq. 3), the baseline of 004.
* :func:`patch_swap`, :func:`restoration_loss`, :func:`centre_classification_loss` -- the two
  pretext tasks of 004's multi-task SSL (Eq. 1-3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "barlow_twins",
    "cross_correlation",
    "moon_contrastive",
    "moon_from_cosines",
    "patch_swap",
    "restoration_loss",
    "centre_classification_loss",
    "multitask_ssl_loss",
]

BT_NORMALISATIONS = ("paper", "batchnorm")


def cross_correlation(
    z_a: torch.Tensor, z_b: torch.Tensor, normalize: str = "paper", eps: float = 1e-8
) -> torch.Tensor:
    """The D×D cross-correlation matrix C of two (N, D) batches of representations.

    ``normalize="paper"`` is Eq. 6 of 004: C_ij = Σ_b a_bi b_bj / (√Σ_b a_bi² · √Σ_b b_bj²),
    i.e. the cosine between dimension i of ``z_a`` and dimension j of ``z_b`` along the batch
    (no centring).  ``normalize="batchnorm"`` is the original Barlow Twins: every dimension is
    standardised over the batch (mean 0, biased std 1, as ``BatchNorm1d(affine=False)``) and
    C = z_aᵀ z_b / N.
    """
    if z_a.shape != z_b.shape or z_a.ndim != 2:
        raise ValueError(
            f"barlow_twins needs two (N, D) tensors of one shape, got {tuple(z_a.shape)} "
            f"and {tuple(z_b.shape)}"
        )
    if normalize == "paper":
        a = z_a / z_a.norm(dim=0, keepdim=True).clamp_min(eps)
        b = z_b / z_b.norm(dim=0, keepdim=True).clamp_min(eps)
        return a.T @ b
    if normalize == "batchnorm":
        n = z_a.shape[0]
        if n < 2:
            raise ValueError("barlow_twins(normalize='batchnorm') needs a batch of at least 2")
        a = (z_a - z_a.mean(0)) / torch.sqrt(z_a.var(0, unbiased=False) + eps)
        b = (z_b - z_b.mean(0)) / torch.sqrt(z_b.var(0, unbiased=False) + eps)
        return a.T @ b / n
    raise ValueError(f"unknown Barlow Twins normalisation {normalize!r}; valid: {list(BT_NORMALISATIONS)}")


def barlow_twins(
    z_a: torch.Tensor, z_b: torch.Tensor, lambd: float = 0.005, normalize: str = "paper"
) -> torch.Tensor:
    """L_BT = Σ_i (1 − C_ii)² + λ Σ_i Σ_{j≠i} C_ij² (Eq. 5 of 004), C from :func:`cross_correlation`."""
    c = cross_correlation(z_a, z_b, normalize)
    diag = torch.diagonal(c)
    on = (1 - diag).pow(2).sum()
    off = c.pow(2).sum() - diag.pow(2).sum()
    return on + lambd * off


def moon_from_cosines(pos: torch.Tensor, neg: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's ℓ_con (Eq. 3 of Li et al. 2021) from cosines, averaged over the batch:
    −log( e^{pos/τ} / (e^{pos/τ} + e^{neg/τ}) ), pos = sim(z, z_glob), neg = sim(z, z_prev)."""
    logits = torch.stack([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(pos), dtype=torch.long, device=pos.device))


def moon_contrastive(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's model-contrastive term: the global model's representation is the positive, the
    previous local model's the negative (cosine similarity, temperature τ)."""
    return moon_from_cosines(
        F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1), tau
    )


def patch_swap(images: torch.Tensor, patch: int, swaps: int, generator: torch.Generator) -> torch.Tensor:
    """Corrupt each image by swapping ``swaps`` random pairs of ``patch``×``patch`` patches
    (context restoration, Chen et al. 2019, ref. [27] of 004).  Patches may overlap."""
    n, _, h, w = images.shape
    if patch > min(h, w) // 2:
        raise ValueError(f"ssl patch size {patch} is too large for {h}×{w} images (at most {min(h, w) // 2})")
    out = images.clone()
    ys = torch.randint(0, h - patch + 1, (n, swaps, 2), generator=generator)
    xs = torch.randint(0, w - patch + 1, (n, swaps, 2), generator=generator)
    for i in range(n):
        for s in range(swaps):
            (y1, y2), (x1, x2) = ys[i, s].tolist(), xs[i, s].tolist()
            a = out[i, :, y1 : y1 + patch, x1 : x1 + patch].clone()
            out[i, :, y1 : y1 + patch, x1 : x1 + patch] = out[i, :, y2 : y2 + patch, x2 : x2 + patch]
            out[i, :, y2 : y2 + patch, x2 : x2 + patch] = a
    return out


def centre_classification_loss(logits: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """L_CE of Eq. 1 of 004: cross-entropy of the predicted centre, mean over the M images."""
    return F.cross_entropy(logits, centres)


def restoration_loss(restored: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """L_MSE of Eq. 2 of 004 ("mean squared error"): mean over images and pixels of
    (G(Q_k) − V_k)²; Eq. 2 sums the squared error per image, which only rescales it by the
    number of pixels -- the mean keeps it on the scale of L_CE in Eq. 3."""
    return F.mse_loss(restored, original)


def multitask_ssl_loss(
    logits: torch.Tensor | None,
    centres: torch.Tensor | None,
    restored: torch.Tensor | None,
    original: torch.Tensor | None,
) -> torch.Tensor:
    """L_SSL = L_CE + L_MSE (Eq. 3 of 004); a task given as None is left out (ablations)."""
    terms = []
    if logits is not None:
        terms.append(centre_classification_loss(logits, centres))
    if restored is not None:
        terms.append(restoration_loss(restored, original))
    if not terms:
        raise ValueError("multitask_ssl_loss needs at least one task")
    return sum(terms)
