"""The cache of decoded pools (:mod:`fedderm.data.sources`).

Decoding image files is the slow part: with ``cache_dir`` the decoded pool is stored once as a
``.pt`` file whose name hashes the inputs (paths, sizes and modification times of every file, and the
arguments), so an unchanged data set is decoded once and any changed file triggers a fresh decode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedderm.atomic import atomic_path
from fedderm.data.pool import ImagePool

logger = logging.getLogger("fedderm.data")

#: Bump whenever decoding or the cache layout changes, to invalidate old cache files.
CACHE_VERSION = 2


def _fingerprint(paths: Iterable[Path], base: Path) -> list[tuple[str, int, int]]:
    """``(path relative to base, size, mtime_ns)`` of each file: what the cache key hashes."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((os.path.relpath(p, base), st.st_size, st.st_mtime_ns))
    return sorted(out)


def _cache_key(
    loader: str,
    path: Path,
    image_size: int,
    skip_bad: bool,
    classes: list[str] | None,
    files: list[tuple[str, int, int]],
    **extra: Any,
) -> str:
    """Hex digest of everything the decoded pool depends on."""
    parts = {
        "version": CACHE_VERSION,
        "loader": loader,
        "path": str(path),
        "image_size": int(image_size),
        "skip_bad_files": bool(skip_bad),
        "classes": classes,
        "files": files,
        **extra,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return f"{loader}-{hashlib.sha256(blob).hexdigest()[:32]}"


def _cached(cache_dir: str | Path | None, key: str, build: Callable[[], ImagePool]) -> ImagePool:
    """``build()``, or its result stored in ``cache_dir/<key>.pt`` by an earlier call."""
    if cache_dir is None:
        return build()
    cache_file = Path(cache_dir).expanduser() / f"{key}.pt"
    pool = _read_cache(cache_file)
    if pool is not None:
        logger.info("loaded %d images from cache %s", len(pool), cache_file)
        return pool
    pool = build()
    _write_cache(pool, cache_file)
    return pool


def _read_cache(cache_file: Path) -> ImagePool | None:
    if not cache_file.is_file():
        return None
    try:
        data = torch.load(cache_file, map_location="cpu", weights_only=True, mmap=True)
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"cache version {data.get('version')} != {CACHE_VERSION}")
        as_numpy = lambda t: None if t is None else t.numpy()  # noqa: E731
        return ImagePool(
            images=data["images"],
            labels=as_numpy(data["labels"]),
            classes=data["classes"],
            sites=as_numpy(data["sites"]),
            site_names=data["site_names"],
            groups=as_numpy(data["groups"]),
            skipped=data["skipped"],
            splits=as_numpy(data["splits"]),
        )
    except Exception as exc:  # a truncated or foreign file: decode again and overwrite it
        logger.warning("ignoring unreadable cache file %s (%s: %s)", cache_file, type(exc).__name__, exc)
        return None


def _write_cache(pool: ImagePool, cache_file: Path) -> None:
    """Store ``pool`` atomically (temporary file + rename); failures are only logged."""
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    images = pool.images.contiguous()
    if images.untyped_storage().nbytes() != images.numel():  # a view: don't save the whole base
        images = images.clone()
    data = {
        "version": CACHE_VERSION,
        "images": images,
        "labels": as_tensor(pool.labels),
        "classes": list(pool.classes),
        "sites": as_tensor(pool.sites),
        "site_names": list(pool.site_names),
        "groups": as_tensor(pool.groups),
        "skipped": list(pool.skipped),
        "splits": as_tensor(pool.splits),
    }
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache_file) as tmp:
            torch.save(data, tmp)
        logger.info("cached %d images in %s", len(pool), cache_file)
    except OSError as exc:
        logger.warning("could not write cache file %s: %s", cache_file, exc)
