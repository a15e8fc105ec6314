"""Every `swarm ... --help` exits 0: the commands and subcommands are walked from the typer app, so a
command added later is covered without a line here. Help text is rendered as rich markup, so a stray
``[/...]`` in a help string crashes it (issue 38)."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from peers.cli import app


def _command_paths(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """``path`` and the paths of every command below it, depth first (a group has ``commands``; typer
    may bundle its own click, so the classes are not checked)."""
    paths = [path]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        paths += _command_paths(sub, (*path, name))
    return paths


PATHS = _command_paths(typer.main.get_command(app))


def test_the_walk_reaches_nested_subcommands() -> None:
    """A walk that stopped at the top level would test only a handful of helps."""
    assert {("config", "check"), ("config", "show"), ("join",), ("local",)} <= set(PATHS)
    assert any(len(path) == 2 and path[0] == "monitor" for path in PATHS)


@pytest.mark.parametrize("path", PATHS, ids=lambda path: " ".join(("swarm", *path)))
def test_every_help_exits_0(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=100)
    assert result.exit_code == 0, f"swarm {' '.join(path)} --help: {result.output}{result.exception!r}"
    assert "Usage" in result.output
