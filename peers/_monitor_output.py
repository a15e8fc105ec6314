"""Terminal sink of the monitor: a live rich table on a terminal, plain prints otherwise, or JSON."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.live import Live

from peers._monitor_table import render
from swarm.metrics import SwarmSnapshot


class TerminalOutput:
    """Shows each snapshot in ``output_format`` (table / json / jsonl).

    A table on a terminal is redrawn in place (rich.live); when stdout is not a terminal every
    refresh prints a plain table (rich drops colour and cursor moves on its own there).
    """

    def __init__(self, output_format: str, *, live: bool, console: Console | None = None):
        self.format = output_format
        self.console = console or Console()
        self._live: Live | None = None
        if output_format == "table" and live and self.console.is_terminal:
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.start()

    def show(self, snapshot: SwarmSnapshot) -> None:
        if self.format == "json":
            typer.echo(json.dumps(snapshot.to_dict(), indent=2, allow_nan=False))
        elif self.format == "jsonl":
            typer.echo(json.dumps(snapshot.to_dict(), separators=(",", ":"), allow_nan=False))
        elif self._live is not None:
            self._live.update(render(snapshot, self.console.width), refresh=True)
        else:
            self.console.print(render(snapshot, self.console.width))

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
