"""`swarm config show|check|pull|keygen`: print, validate or fetch a run config, make a swarm key.

This module is imported by every command, so it stays cheap: torch and hivemind are imported inside
the commands that need them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.syntax import Syntax

from peers import _common as common
from swarm.config import RunConfig

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


@config_app.command("show")
def show(file: str = FILE_ARGUMENT, set_: list[str] | None = SET_OPTION) -> None:
    """Print the fully resolved config as YAML, then its config hash."""
    config = common.load_config_or_exit(file, set_ or ())
    console = Console()
    text = config.to_yaml()
    if console.is_terminal:
        console.print(Syntax(text, "yaml", background_color="default"))
    else:
        typer.echo(text, nl=False)
    typer.echo(f"config hash: {config.config_hash()}")


@config_app.command("check")
def check(
    file: str = FILE_ARGUMENT,
    set_: list[str] | None = SET_OPTION,
    estimate: bool = typer.Option(
        True, "--estimate/--no-estimate", help="Also print memory per peer and wire bytes per sync."
    ),
) -> None:
    """Validate a config: print OK and its hash (exit 0), or every error to stderr (exit 2).

    Then estimate what one peer needs: GPU memory (CPU memory when run on the CPU) and bytes on the
    wire per sync, see docs/hosting.md.
    """
    config = common.load_config_or_exit(file, set_ or ())
    from swarm.pipeline import plan_stages

    try:
        plan_stages(config)  # a pipeline section that cannot cut this model (or fit its budget)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"OK: {file} (config hash {config.config_hash()})")
    if estimate:
        from swarm.pipeline import describe_stages
        from swarm.training.estimate import describe_estimate, estimate_peer

        device = "cpu" if config.train.device == "cpu" else "cuda"
        checkpointing = config.train.activation_checkpointing
        for line in describe_estimate(estimate_peer(config, device), checkpointing):
            typer.echo(line)
        for line in describe_stages(config, device):  # pipelined runs: what each stage peer needs
            typer.echo(line)


@config_app.command("pull")
def pull(
    initial_peers: list[str] = typer.Option(
        ...,
        "--initial-peers",
        help="A peer of the swarm (the address `swarm bootstrap` printed).",
        show_default=False,
    ),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the config YAML."),
    run_id: str | None = typer.Option(
        None, "--run-id", help="The run to fetch (default: the one the initial peer publishes)."
    ),
) -> None:
    """Fetch the swarm's published run config, verify its hash, write it (exit 2 if none is published)."""
    from peers._compat_check import look_at_swarm, open_probe

    defaults = RunConfig()
    network = common.resolve_network(defaults, common.NetworkFlags(initial_peers=initial_peers))
    with open_probe(network, defaults) as node:
        view = look_at_swarm(node, network, run_id)
    if not view.run_id:
        common.fail("no run is published through these initial peers; name it with --run-id")
    if view.published_yaml is None:
        common.fail(f"no valid config is published for run {view.run_id!r} (is its bootstrap up to date?)")
    write_atomically(output, view.published_yaml)
    typer.echo(f"wrote {output}: run {view.run_id!r}, config hash {view.published_hash}")


@config_app.command("keygen")
def keygen(
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the new key (must not exist)."),
) -> None:
    """Make a secret key for a private swarm (32 random bytes, hex) in a new file of mode 0600.

    Copy the file to every peer over a secure channel and point network.swarm_key_file at it
    (or put its content in SWARM_KEY). See docs/security.md.
    """
    from swarm.network import write_new_key

    try:
        key = write_new_key(output)
    except FileExistsError:
        typer.echo(f"error: {output} already exists; refusing to overwrite a key", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.echo(f"error: cannot create {output}: {exc.strerror}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote a new swarm key to {output} (mode 0600, fingerprint {key.fingerprint})")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
