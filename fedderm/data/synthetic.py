"""Generated dermatology-like images: the embedded default data set, no download needed.

Five lesion classes differ in shape, colour and texture; every site has its own skin tone,
lighting and colour cast, so that sites are non-IID in appearance as in the skin-colour split of
paper 000 §V-A.  Same ``seed`` -> same pixels; the pool is generated once and cached.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from fedderm.atomic import atomic_path

from .pool import ImagePool

log = logging.getLogger("fedderm.data")

CLASSES = ["nevus", "melanoma", "basal_cell_carcinoma", "keratosis", "vascular"]
CACHE_VERSION = 2

# Skin tones from light to dark (RGB, 0-1), interpolated across sites.
_TONES = np.array([[0.96, 0.83, 0.72], [0.87, 0.68, 0.52], [0.70, 0.50, 0.36], [0.45, 0.31, 0.22]])


def _site_style(site: int, num_sites: int, rng: np.random.Generator) -> dict:
    """Skin tone, brightness, colour cast and vignette direction of one site (its camera/ward)."""
    t = site / max(num_sites - 1, 1) * (len(_TONES) - 1)
    lo = int(np.floor(t))
    hi = min(lo + 1, len(_TONES) - 1)
    tone = _TONES[lo] + (t - lo) * (_TONES[hi] - _TONES[lo])
    return {
        "tone": tone,
        "gain": rng.uniform(0.8, 1.15),
        "cast": rng.uniform(-0.06, 0.06, size=3),
        "light_dir": rng.uniform(0, 2 * np.pi),
    }


def _lesion(kind: int, xx: np.ndarray, yy: np.ndarray, rng: np.random.Generator):
    """Return (alpha mask HxW in [0,1], colour image HxWx3) of one lesion of class ``kind``."""
    cx, cy = rng.uniform(-0.15, 0.15, size=2)
    angle = rng.uniform(0, 2 * np.pi)
    dx, dy = xx - cx, yy - cy
    u = dx * np.cos(angle) + dy * np.sin(angle)
    v = -dx * np.sin(angle) + dy * np.cos(angle)
    rho, theta = np.hypot(u, v), np.arctan2(v, u)
    colour = np.zeros(xx.shape + (3,))
    if kind == 0:  # nevus: small, round, uniform brown, smooth edge
        r = rng.uniform(0.22, 0.32)
        dist = np.hypot(u, v / rng.uniform(0.85, 1.0)) / r
        colour[:] = np.array([0.45, 0.28, 0.16]) * rng.uniform(0.85, 1.1)
        edge = 0.08
    elif kind == 1:  # melanoma: large, asymmetric irregular border, blotchy brown/black/blue-grey
        r = rng.uniform(0.33, 0.45)
        k = np.arange(2, 7)
        border = 1 + (
            rng.uniform(0.06, 0.16, len(k))[:, None, None]
            * np.cos(k[:, None, None] * theta + rng.uniform(0, 2 * np.pi, len(k))[:, None, None])
        ).sum(0)
        dist = rho / (r * border)
        blotch = np.sin(7 * u + rng.uniform(0, 6)) * np.cos(6 * v + rng.uniform(0, 6))
        dark, brown, blue = (
            np.array([0.12, 0.08, 0.07]),
            np.array([0.36, 0.2, 0.1]),
            np.array([0.35, 0.4, 0.5]),
        )
        w = (blotch[..., None] + 1) / 2
        colour[:] = w * dark + (1 - w) * brown
        colour = np.where((blotch > 0.6)[..., None], blue, colour)
        edge = 0.03
    elif kind == 2:  # basal cell carcinoma: pink pearly nodule with red branching vessels
        r = rng.uniform(0.25, 0.38)
        dist = np.hypot(u, v / rng.uniform(0.7, 0.95)) / r
        colour[:] = np.array([0.86, 0.6, 0.6])
        vessels = np.abs(np.sin(18 * u + 4 * np.sin(9 * v))) < 0.18
        colour = np.where(vessels[..., None], np.array([0.7, 0.12, 0.15]), colour)
        edge = 0.1
    elif kind == 3:  # keratosis: waxy tan, squarish, dotted "stuck-on" texture
        r = rng.uniform(0.28, 0.4)
        dist = (np.abs(u) ** 4 + np.abs(v) ** 4) ** 0.25 / r
        dots = (np.sin(30 * u) * np.sin(30 * v)) > 0.55
        colour[:] = np.array([0.66, 0.5, 0.3])
        colour = np.where(dots[..., None], np.array([0.32, 0.22, 0.12]), colour)
        edge = 0.05
    else:  # vascular: cluster of small red-purple lacunae
        dist = np.full(xx.shape, np.inf)
        for _ in range(rng.integers(3, 7)):
            ox, oy = rng.uniform(-0.18, 0.18, size=2)
            dist = np.minimum(dist, np.hypot(u - ox, v - oy) / rng.uniform(0.07, 0.13))
        colour[:] = np.array([0.58, 0.1, 0.28]) * rng.uniform(0.8, 1.1)
        edge = 0.15
    alpha = np.clip((1 + edge - dist) / (2 * edge), 0, 1) * rng.uniform(0.8, 1.0)
    return alpha, colour


def render_image(kind: int, style: dict, size: int, rng: np.random.Generator) -> np.ndarray:
    """One RGB uint8 image (size x size x 3) of lesion class ``kind`` on a site's skin."""
    lin = (np.arange(size) + 0.5) / size * 2 - 1
    xx, yy = np.meshgrid(lin, lin)
    skin = style["tone"] + style["cast"]
    mottle = 0.04 * np.sin(rng.uniform(2, 5) * xx + rng.uniform(0, 6)) * np.cos(rng.uniform(2, 5) * yy)
    img = np.broadcast_to(skin, xx.shape + (3,)) * (1 + mottle[..., None])
    alpha, colour = _lesion(kind, xx, yy, rng)
    img = img * (1 - alpha[..., None]) + colour * alpha[..., None]
    if rng.random() < 0.3:  # a hair
        a, b = rng.uniform(-1, 1, size=2)
        hair = np.abs(yy - (a * xx + b + 0.1 * np.sin(5 * xx))) < 0.012
        img = np.where(hair[..., None], 0.1, img)
    d = style["light_dir"]
    light = 1 + 0.18 * (np.cos(d) * xx + np.sin(d) * yy) - 0.2 * (xx**2 + yy**2)
    img = img * style["gain"] * light[..., None] + rng.normal(0, 0.015, img.shape)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)


def generate(num_sites: int, per_class: int, image_size: int, seed: int) -> ImagePool:
    """Generate ``num_sites * len(CLASSES) * per_class`` images, class-balanced per site."""
    rng = np.random.default_rng([seed, num_sites, image_size])
    images, labels, sites = [], [], []
    for site in range(num_sites):
        style = _site_style(site, num_sites, rng)
        for kind in range(len(CLASSES)):
            for _ in range(per_class):
                images.append(render_image(kind, style, image_size, rng))
                labels.append(kind)
                sites.append(site)
    tensor = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return ImagePool(
        images=tensor,
        labels=np.asarray(labels, dtype=np.int64),
        classes=list(CLASSES),
        sites=np.asarray(sites, dtype=np.int64),
        site_names=[f"site{s}" for s in range(num_sites)],
    )


#: the ImagePool fields that are numpy arrays (stored as tensors: torch.load weights_only reads them)
_NUMPY_FIELDS = ("labels", "sites", "groups", "splits")


def _read_cache(path: Path) -> ImagePool | None:
    """The pool cached in ``path``, or None when it cannot be read safely: loaded with
    ``weights_only`` (a cache file is a file on disk: a pickle that would run code is refused, and
    the data generated again)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        fields = {
            k: (v.numpy() if k in _NUMPY_FIELDS and isinstance(v, torch.Tensor) else v)
            for k, v in data.items()
        }
        return ImagePool(**fields)
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file: generate again and overwrite it
        log.warning("ignoring unreadable cache file %s (%s: %s)", path, type(err).__name__, str(err)[:200])
        return None


def load_synthetic(
    num_sites: int, per_class: int, image_size: int, seed: int, cache_dir: str | Path | None = None
) -> ImagePool:
    """:func:`generate`, cached under ``cache_dir`` (generated once per setting)."""
    if cache_dir is None:
        return generate(num_sites, per_class, image_size, seed)
    key = hashlib.sha1(f"{CACHE_VERSION}-{num_sites}-{per_class}-{image_size}-{seed}".encode()).hexdigest()[
        :16
    ]
    path = Path(cache_dir).expanduser() / f"synthetic-{key}.pt"
    if path.is_file() and (pool := _read_cache(path)) is not None:
        return pool
    log.info(
        "generating synthetic data: %d sites x %d classes x %d images, %d px",
        num_sites,
        len(CLASSES),
        per_class,
        image_size,
    )
    pool = generate(num_sites, per_class, image_size, seed)
    stored = {
        k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v)
        for k, v in pool.__dict__.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(stored, tmp)
    return pool
