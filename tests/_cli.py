"""The ``swarm`` command run in process (typer's runner), for the tests of how it refuses bad input."""

from __future__ import annotations

from typer.testing import CliRunner

from peers.cli import app


def refused_output(args: list[str]) -> str:
    """Run ``swarm ARGS``; assert that it exits 2 (bad input) and return what it printed."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    return result.output
