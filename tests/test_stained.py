"""dataset="stained-digits" (fedderm/data/stained.py): the digits dealt out to centres that differ
in stain, contrast, blur and noise, and in nothing else."""

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("sklearn")

from fedderm.config import parse_config  # noqa: E402
from fedderm.data import load_client_data  # noqa: E402
from fedderm.data.digits import CLASSES, digits_arrays, load_digits_pool  # noqa: E402
from fedderm.data.stained import (  # noqa: E402
    EOSIN,
    HAEMATOXYLIN,
    STYLES,
    Style,
    centre_styles,
    load_stained_digits_pool,
    render,
)

SIZE = 16
PLAIN = Style(HAEMATOXYLIN, EOSIN, h=1.0, e=0.3, gamma=1.0, blur=0.0, noise=0.0)


def ink() -> np.ndarray:
    return digits_arrays(SIZE)[0].astype(np.float32) / 255


def test_pool_shapes_and_disjoint_label_balanced_centres_the_same_as_digits():
    pool = load_stained_digits_pool(SIZE, sites=3, seed=5)
    assert tuple(pool.images.shape) == (1797, 3, SIZE, SIZE) and str(pool.images.dtype) == "torch.uint8"
    assert pool.classes == CLASSES and pool.site_names == ["site0", "site1", "site2"]
    assert (pool.labels == digits_arrays(SIZE)[1]).all()  # image i is digit i
    counts = np.array([np.bincount(pool.labels[pool.sites == s], minlength=10) for s in range(3)])
    assert (counts.max(0) - counts.min(0) <= 1).all() and counts.sum() == 1797  # every class evenly
    assert (pool.sites == load_digits_pool(SIZE, sites=3, seed=5).sites).all()  # digits' shares


def test_deterministic_per_seed_styles_fixed_per_centre():
    a, b = load_stained_digits_pool(SIZE, 3, seed=1), load_stained_digits_pool(SIZE, 3, seed=1)
    assert (a.sites == b.sites).all() and (a.images == b.images).all()
    c = load_stained_digits_pool(SIZE, 3, seed=2)
    assert (a.sites != c.sites).any()  # the seed deals the digits out anew
    assert centre_styles(3) == list(STYLES)  # and never changes a centre's style


def test_each_image_is_its_digit_in_its_centres_style_and_nothing_else():
    """Noise-free, image i is render(digit i, its centre's style); with one style for every centre
    the centres are indistinguishable: nothing but the style depends on the centre."""
    quiet = [replace(s, noise=0.0) for s in STYLES]
    pool = load_stained_digits_pool(SIZE, 3, seed=3, styles=quiet)
    images = pool.images.permute(0, 2, 3, 1).numpy()
    for c, style in enumerate(quiet):
        at = pool.sites == c
        assert np.array_equal(images[at], render(ink()[at], style))
    same = load_stained_digits_pool(SIZE, 3, seed=3, styles=[quiet[1]] * 3)
    assert np.array_equal(same.images.permute(0, 2, 3, 1).numpy(), render(ink(), quiet[1]))
    noisy = load_stained_digits_pool(SIZE, 3, seed=3).images.permute(0, 2, 3, 1).numpy()
    for c, style in enumerate(STYLES):  # the noise is the only difference, of the style's size
        at = pool.sites == c
        residual = noisy[at].astype(np.float64) - images[at]
        assert abs(residual.mean()) < 0.5 and residual.std() == pytest.approx(255 * style.noise, rel=0.2)


def test_stain_is_beer_lambert_haematoxylin_ink_on_eosin():
    grey = np.zeros((1, 4, 4), np.float32)
    grey[0, :, 2:] = 1.0  # background left, full ink right
    out = render(grey, PLAIN) / 255
    h = np.array(HAEMATOXYLIN) / np.linalg.norm(HAEMATOXYLIN)
    e = np.array(EOSIN) / np.linalg.norm(EOSIN)
    assert np.allclose(out[0, 0, 0], 10 ** -(0.3 * e), atol=1 / 255)
    assert np.allclose(out[0, 0, 3], 10 ** -(1.0 * h + 0.3 * e), atol=1 / 255)
    r, g, b = out[0, 0, 0]
    assert r > g and b > g  # eosin: pink background
    r, g, b = out[0, 0, 3]
    assert b > r > g and out[0, 0, 3].sum() < out[0, 0, 0].sum()  # haematoxylin: darker, blue-purple ink


def test_blur_gamma_and_noise_do_what_they_say():
    grey = ink()[:50]
    plain = render(grey, PLAIN).astype(np.float64)
    blurred = render(grey, replace(PLAIN, blur=0.1)).astype(np.float64)

    def variation(x):
        return np.abs(np.diff(x, axis=1)).mean() + np.abs(np.diff(x, axis=2)).mean()

    assert variation(blurred) < 0.75 * variation(plain)  # softer edges
    assert abs(blurred.mean() - plain.mean()) < 1.0  # the same stain on average
    gamma = render(grey, replace(PLAIN, gamma=1.5)).astype(np.float64)
    assert np.allclose(gamma, 255 * (plain / 255) ** 1.5, atol=1.5)  # RGB ** gamma, up to rounding
    noisy = render(grey, replace(PLAIN, noise=0.05), np.random.default_rng(0)).astype(np.float64)
    assert (noisy - plain).std() == pytest.approx(255 * 0.05, rel=0.1)
    assert np.array_equal(render(grey, replace(PLAIN, noise=0.05)), plain)  # no rng: no noise


def test_the_three_centres_differ_in_colour_contrast_and_sharpness():
    """Every pair of centres differs by at least a third of an SD in some colour channel's mean:
    the statistics the first BatchNorm layer normalises with are not those of another centre."""
    pool = load_stained_digits_pool(32, 3, seed=0)
    x = pool.images.double() / 255
    stats = [
        (x[pool.sites == c].mean((0, 2, 3)).numpy(), x[pool.sites == c].std((0, 2, 3)).numpy())
        for c in range(3)
    ]
    for a in range(3):
        for b in range(a + 1, 3):
            (ma, sa), (mb, sb) = stats[a], stats[b]
            assert (np.abs(ma - mb) / np.sqrt((sa**2 + sb**2) / 2)).max() > 0.35
    grey = digits_arrays(32)[0][:100].astype(np.float32) / 255  # the same digits in each style
    quiet = [render(grey, replace(s, noise=0.0)).astype(np.float64) for s in STYLES]
    contrast = [x.std() for x in quiet]
    sharpness = [np.abs(np.diff(x, axis=2)).mean() / x.std() for x in quiet]
    assert sharpness[1] < 0.95 * sharpness[0]  # the second centre is out of focus
    assert contrast[2] > 1.15 * max(contrast[:2])  # the third has the most contrast


def test_centre_styles_interpolate_beyond_three():
    assert centre_styles(2) == [STYLES[0], STYLES[2]]
    five = centre_styles(5)
    assert five[0] == STYLES[0] and five[2] == STYLES[1] and five[4] == STYLES[2]
    assert five[1].h == pytest.approx((STYLES[0].h + STYLES[1].h) / 2)
    assert centre_styles(1) == [STYLES[0]]


def test_run_config_deals_one_centre_to_each_client_without_a_data_path():
    cfg = parse_config(
        {"dataset": "stained-digits", "partition": "source", "image-size": SIZE, "seed": 7, "min-clients": 3}
    )
    data = [load_client_data(cfg, c, 3) for c in range(3)]
    for c, d in enumerate(data):
        idx = np.concatenate([d.split.train, d.split.val, d.split.test])
        assert (d.pool.sites[idx] == c).all() and len(idx) == (d.pool.sites == c).sum()  # all of centre c
        assert min(d.class_counts()["test"]) >= 10  # every class in every centre's test split
    assert sum(len(d.split.test) for d in data) >= 3 * 115
