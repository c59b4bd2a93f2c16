"""Atomic file writes: a reader (or a resumed run after a crash) sees the old file or the new one,
never a part of either; with ``fsync`` also after a power cut."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_folder(folder: str | Path) -> None:
    """Flush ``folder``'s entries (a rename into it, a file made or removed in it) to disk.

    A file's own fsync does not make its name durable: after a power cut ext4 and xfs can show
    the rename undone, or the new name pointing at an empty file, unless the folder is flushed
    too (fsync(2), "Notes")."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # a file system that cannot flush a folder (some network ones): nothing more to do
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, mode: int | None = None, fsync: bool = False) -> Iterator[Path]:
    """A temporary file beside ``path`` (the same file system, so ``os.replace`` is atomic) for the
    block to write; it replaces ``path`` when the block ends and is removed if the block raises.

    ``mode``: the file's permission bits (``mkstemp`` makes it 0600); ``fsync``: flush the file
    before the rename and the folder after it, so that ``path`` survives a power cut whole (the
    new file or, had the cut come before the rename, the old one)."""
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
    if fsync:
        fsync_folder(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path, mode, fsync) as tmp:
        tmp.write_bytes(data)
