"""Names that become folders: one rule for every id that turns into a path component.

A run name, a run token, a partition id or a site name may come from the other side of the
federation (a server's message, a client's handshake).  Before it becomes part of a path it is
reduced to one safe folder name (:func:`safe_component`), and the path built from it is checked to
stay inside the folder that owns it (:func:`inside`): no ``..``, no separator, no leading dot, a
strict set of characters, a bounded length.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

__all__ = ["MAX_COMPONENT", "PathError", "inside", "is_safe_component", "safe_component"]

#: the longest folder name this module makes (file systems take 255 bytes; a run folder gets a suffix)
MAX_COMPONENT = 128
_SAFE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9._-]+")


class PathError(ValueError):
    """A path built from a name would leave the folder that owns it; the message names both."""


def is_safe_component(name: object) -> bool:
    """Whether ``name`` is one folder name as it stands: letters, digits, ``.``, ``_``, ``-``, not
    starting with ``.`` or ``-``, no ``..``, at most :data:`MAX_COMPONENT` characters."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= MAX_COMPONENT
        and _SAFE.fullmatch(name) is not None
        and ".." not in name
    )


def safe_component(name: object) -> str:
    """``name`` as one safe folder name: unchanged when :func:`is_safe_component`, else its safe
    characters joined by ``-`` and a digest of the whole name (two different names never meet:
    ``x/../../evil`` becomes ``x-evil-<8 hex>``), at most :data:`MAX_COMPONENT` characters."""
    text = str(name)
    if is_safe_component(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    readable = re.sub(r"\.{2,}", ".", _UNSAFE_RUN.sub("-", text)).strip(".-_")
    readable = readable[: MAX_COMPONENT - len(digest) - 1].rstrip(".-_")
    return f"{readable}-{digest}" if readable else f"x-{digest}"


def inside(base: str | Path, *parts: str) -> Path:
    """``base/part/...`` after checking that every part is one safe folder name and that the path,
    links resolved, stays inside ``base``; raises :class:`PathError` naming both otherwise."""
    root = Path(base).expanduser().resolve()
    for part in parts:
        if not is_safe_component(part):
            raise PathError(f"{part!r} is not a single safe folder name (inside {root})")
    path = root.joinpath(*parts)
    real = path.resolve()
    if real != root and root not in real.parents:
        raise PathError(f"{path} leads outside {root} (to {real}): refused")
    return path
