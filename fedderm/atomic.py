"""Atomic file writes: a reader (or a resumed run after a crash) sees the old file or the new one,
never a part of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path, mode: int | None = None, fsync: bool = False) -> Iterator[Path]:
    """A temporary file beside ``path`` (the same file system, so ``os.replace`` is atomic) for the
    block to write; it replaces ``path`` when the block ends and is removed if the block raises.

    ``mode``: the file's permission bits (``mkstemp`` makes it 0600); ``fsync``: flush it to disk
    before the rename (for records that must survive a power cut, not only a crash)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        if mode is not None:
            os.chmod(tmp, mode)
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path, mode, fsync) as tmp:
        tmp.write_bytes(data)
