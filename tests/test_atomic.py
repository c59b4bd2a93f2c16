"""fedderm.atomic: one way to write a file so that readers never see a part of it."""

import os
import stat

import pytest

from fedderm.atomic import atomic_path, atomic_write_bytes


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_write_replaces_the_file_with_the_given_mode(tmp_path):
    path = tmp_path / "model.pt"
    atomic_write_bytes(path, b"new", mode=0o640, fsync=True)
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    with atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp != path  # beside it: os.replace stays atomic
        tmp.write_bytes(b"newer")
        assert path.read_bytes() == b"new"  # readers see the old file until the block ends
    assert path.read_bytes() == b"newer" and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
