"""Whole directories written atomically: a synced JSON file, and a directory renamed into place.

``swarm export`` and ``swarm data prepare`` both build their output in a temporary directory beside the
target and rename it into place, so a reader sees the old directory or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def write_json_synced(path: Path, data: dict[str, Any], indent: int = 2) -> None:
    """Write ``data`` as sorted JSON to ``path`` and fsync it before returning."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=indent, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def replace_directory(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; a non-empty ``target`` is moved aside first and removed after,
    or moved back if the rename fails (``target`` is then as it was).

    The parent directory is synced after the rename, so the new name survives a crash."""
    old = None
    if target.is_dir() and any(target.iterdir()):
        old = target.parent / f".{target.name}.{os.getpid()}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    try:
        os.replace(new, target)  # onto an empty directory, or a free name
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
