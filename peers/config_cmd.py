"""`swarm config show|check`: print or validate a run config, and the loader other commands share."""

from __future__ import annotations

import os
from collections.abc import Sequence

import typer
from rich.console import Console
from rich.syntax import Syntax

from swarm.config import ConfigError, RunConfig, load_config

config_app = typer.Typer(
    help="Inspect and validate run configs (YAML file < SWARM_* environment < --set).",
    no_args_is_help=True,
)

FILE_ARGUMENT = typer.Argument(
    ..., help="Run config YAML file, e.g. configs/local-tiny.yaml.", show_default=False
)
SET_OPTION = typer.Option(
    None,
    "--set",
    help="Override one key, e.g. --set train.lr=1e-3 or --set network.initial_peers=[/ip4/...]. Repeatable.",
    show_default=False,
)


def load_config_or_exit(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a config; on any problem print each error line to stderr and exit with status 2."""
    try:
        return load_config(path, overrides=tuple(overrides))
    except ConfigError as exc:
        for line in exc.errors:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2) from None


@config_app.command("show")
def show(file: str = FILE_ARGUMENT, set_: list[str] | None = SET_OPTION) -> None:
    """Print the fully resolved config as YAML, then its config hash."""
    config = load_config_or_exit(file, set_ or ())
    console = Console()
    text = config.to_yaml()
    if console.is_terminal:
        console.print(Syntax(text, "yaml", background_color="default"))
    else:
        typer.echo(text, nl=False)
    typer.echo(f"config hash: {config.config_hash()}")


@config_app.command("check")
def check(file: str = FILE_ARGUMENT, set_: list[str] | None = SET_OPTION) -> None:
    """Validate a config: print OK and its hash (exit 0), or every error to stderr (exit 2)."""
    config = load_config_or_exit(file, set_ or ())
    typer.echo(f"OK: {file} (config hash {config.config_hash()})")
