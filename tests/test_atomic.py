"""swarm._atomic: a directory renamed into place replaces the old one whole, or leaves it as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarm._atomic import replace_directory


def _directory(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "file.txt").write_text(text)
    return path


def test_a_new_directory_replaces_a_non_empty_one_and_nothing_is_left_aside(tmp_path: Path) -> None:
    target = _directory(tmp_path / "out", "old")
    replace_directory(_directory(tmp_path / "new", "new"), target)
    assert (target / "file.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_rename_leaves_the_old_directory_where_it_was(tmp_path: Path, monkeypatch) -> None:
    """The old directory is moved aside before the new one is renamed in; if that rename fails (a full
    disk, a permission), the old one must come back under its own name, not stay hidden beside it."""
    target = _directory(tmp_path / "out", "old")
    new = _directory(tmp_path / "new", "new")

    def refused(src, dst) -> None:
        raise PermissionError(f"refused: {src} -> {dst}")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(PermissionError, match="refused"):
        replace_directory(new, target)
    assert (target / "file.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]
