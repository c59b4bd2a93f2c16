"""Centres that differ the way histopathology centres do: scikit-learn's digits, stained.

``dataset="stained-digits"``: the 1,797 digits of :mod:`fedderm.data.digits` dealt out to
``synthetic-sites`` centres (0: one per client) in disjoint, label-balanced shares (the same shares
as ``dataset="digits"`` for the same seed), and each centre's share rendered in that centre's
:class:`Style`, in the order an image is made:

1. **stain**: the digit's ink is haematoxylin, the background eosin, each an optical-density
   colour vector (Ruifrok & Johnston 2001, the H&E vectors of scikit-image's ``rgb_from_hed``),
   through Beer-Lambert's law, ``RGB = 10 ** -(ink * h * H + e * E)``; centres differ in the stain
   vectors (hue) and concentrations (intensity), as stain brands, batches and protocols do;
2. **optics**: a Gaussian blur (the scanner's focus), σ a fraction of the image side;
3. **tone curve**: ``RGB ** gamma`` (the scanner's contrast);
4. **sensor noise**: Gaussian, per pixel and channel.

Only the style depends on the centre (``render`` of the same digit in the same style gives the
same image at every centre, noise aside), and the labels are balanced across centres: the centres
differ in features only, the shift of 004's three breast-histopathology centres (004 §IV-A). The
styles are fixed per centre (not drawn from ``seed``), as 004's centres are; ``seed`` deals the
digits out and draws the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .digits import CLASSES, deal_out, digits_arrays
from .pool import ImagePool

__all__ = ["STYLES", "Style", "centre_styles", "load_stained_digits_pool", "render"]

_CHUNK = 256

#: Ruifrok & Johnston's haematoxylin and eosin optical densities per unit stain (R, G, B)
HAEMATOXYLIN = (0.65, 0.70, 0.29)
EOSIN = (0.07, 0.99, 0.11)


@dataclass(frozen=True)
class Style:
    """How one centre renders its images (see the module docstring for each step)."""

    haematoxylin: tuple[float, float, float]  # OD colour vector of the ink (normalised when used)
    eosin: tuple[float, float, float]  # OD colour vector of the background
    h: float  # haematoxylin concentration at full ink
    e: float  # eosin concentration everywhere
    gamma: float  # tone curve exponent
    blur: float  # Gaussian σ as a fraction of the image side
    noise: float  # Gaussian noise σ on intensities in [0, 1]


#: The styles of three centres, for 3 centres exactly these: pale and sharp (light staining, a clean
#: scanner); red-purple haematoxylin on more eosin, out of focus; blue haematoxylin, higher contrast
#: and a noisier sensor.  Chosen so that a tiny CNN trained on one centre alone loses most of its
#: validation accuracy on another centre and regains it with that centre's BatchNorm statistics
#: (``python -m bench.centre_shift``; docs/data.md), while every centre's digits stay legible.
STYLES = (
    Style(HAEMATOXYLIN, EOSIN, h=0.8, e=0.25, gamma=0.9, blur=0.0, noise=0.02),
    Style((0.58, 0.75, 0.31), (0.06, 0.95, 0.25), h=0.9, e=0.35, gamma=1.0, blur=0.03, noise=0.02),
    Style((0.70, 0.66, 0.26), (0.08, 0.99, 0.10), h=1.1, e=0.25, gamma=1.25, blur=0.015, noise=0.04),
)


def _mix(a: Style, b: Style, t: float) -> Style:
    """The style a fraction ``t`` of the way from ``a`` to ``b`` (every number interpolated)."""

    def lerp(x, y):
        return tuple(u + t * (v - u) for u, v in zip(x, y)) if isinstance(x, tuple) else x + t * (y - x)

    return Style(**{f: lerp(getattr(a, f), getattr(b, f)) for f in Style.__dataclass_fields__})


def centre_styles(num_centres: int) -> list[Style]:
    """The styles of ``num_centres`` centres: :data:`STYLES` for 3; for another number, spread evenly
    from the first to the last of them (interpolated), so 2 centres are the two extremes."""
    if num_centres < 1:
        raise ValueError(f"num_centres must be >= 1, got {num_centres}")
    if num_centres == 1:
        return [STYLES[0]]
    styles = []
    for k in range(num_centres):
        t = k / (num_centres - 1) * (len(STYLES) - 1)
        lo = min(int(np.floor(t)), len(STYLES) - 2)
        styles.append(_mix(STYLES[lo], STYLES[lo + 1], t - lo))
    return styles


def _unit(v: Sequence[float]) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return (v / np.linalg.norm(v)).astype(np.float32)


def render(grey: np.ndarray, style: Style, rng: np.random.Generator | None = None) -> np.ndarray:
    """Images ``grey`` (N×S×S, ink in [0, 1]) in ``style``: uint8 N×S×S×3.

    ``rng`` draws the sensor noise; ``None`` leaves it out (the noise-free rendering).
    """
    grey = np.asarray(grey, dtype=np.float32)
    size = grey.shape[-1]
    od = grey[..., None] * (style.h * _unit(style.haematoxylin)) + style.e * _unit(style.eosin)
    rgb = np.exp(od * np.float32(-np.log(10.0)))  # 10 ** -od
    if style.blur > 0:
        from scipy.ndimage import gaussian_filter  # imported on first use, as scikit-learn's digits are

        sigma = style.blur * size
        rgb = gaussian_filter(rgb, sigma=(0, sigma, sigma, 0), mode="nearest")
    rgb = np.power(np.clip(rgb, 0.0, 1.0), np.float32(style.gamma))
    if rng is not None and style.noise > 0:
        rgb += np.float32(style.noise) * rng.standard_normal(size=rgb.shape, dtype=np.float32)
    return (np.clip(rgb, 0.0, 1.0) * 255).round().astype(np.uint8)


def load_stained_digits_pool(
    image_size: int, sites: int, seed: int = 0, styles: Sequence[Style] | None = None
) -> ImagePool:
    """The digits dealt out to ``sites`` centres, each share rendered in its centre's style.

    Image ``i`` of the pool is digit ``i`` of scikit-learn's set (the order is kept); ``styles``
    replaces :func:`centre_styles` (one per centre).
    """
    if sites < 1:
        raise ValueError(f"stained-digits needs at least 1 centre, got sites={sites}")
    styles = list(styles) if styles is not None else centre_styles(sites)
    if len(styles) != sites:
        raise ValueError(f"{len(styles)} styles for {sites} centres")
    grey, labels = digits_arrays(image_size)
    site = deal_out(labels, sites, np.random.default_rng(seed))
    ink = grey.astype(np.float32) / 255.0
    out = np.empty((len(labels), image_size, image_size, 3), dtype=np.uint8)
    for c, style in enumerate(styles):
        idx = np.flatnonzero(site == c)
        rng = np.random.default_rng([seed, sites, c])
        for chunk in np.array_split(idx, max(1, -(-len(idx) // _CHUNK))):  # bounded memory at 224 px
            out[chunk] = render(ink[chunk], style, rng)
    return ImagePool(
        images=torch.from_numpy(out).permute(0, 3, 1, 2).contiguous(),
        labels=labels,
        classes=CLASSES,
        sites=site,
        site_names=[f"site{s}" for s in range(sites)],
    )
