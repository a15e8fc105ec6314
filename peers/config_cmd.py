"""`swarm config show|check|pull|keygen`: print, validate or fetch a run config, make a swarm key.

This module is imported by every command, so it stays cheap: torch and hivemind are imported inside
the commands that need them.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.syntax import Syntax

from peers import _common as common
from swarm.config import PER_PEER_KEYS, RunConfig

if TYPE_CHECKING:
    from peers._compat_check import SwarmView
    from swarm.network import NetworkOptions

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
    help="Override one key, e.g. --set train.lr=1e-3 or --set network.initial_peers=/ip4/.... Repeatable.",
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
    device_memory: str | None = typer.Option(
        None,
        "--device-memory",
        help="Say whether a peer fits this much GPU memory, e.g. 12GiB (exit 1 if not).",
    ),
    host_memory: str | None = typer.Option(
        None,
        "--host-memory",
        help="Say whether a peer fits this much host memory, e.g. 16GiB (exit 1 if not).",
    ),
) -> None:
    """Validate a config: print OK and its hash (exit 0), or every error to stderr (exit 2).

    Then estimate what one peer needs: GPU memory (CPU memory when run on the CPU) and bytes on the
    wire per sync, see docs/hosting.md. With ``--device-memory``/``--host-memory``, also say whether
    the peer fits that machine, in which layout, and what to change if not (exit 1 if not).
    """
    from swarm.learning.fit import parse_memory_size

    try:
        limits = [None if size is None else parse_memory_size(size) for size in (device_memory, host_memory)]
    except ValueError as exc:
        common.fail(str(exc))
    config = common.load_config_or_exit(file, set_ or ())
    from swarm.learning.model import hf_model_config
    from swarm.pipeline import plan_stages

    try:
        if config.model.kind == "hf":
            hf_model_config(config.model)  # what transformers rejects, named by its key
        plan_stages(config)  # a pipeline section that cannot cut this model (or fit its budget)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"OK: {file} (config hash {config.config_hash()})")
    if estimate:
        from swarm.learning.estimate import estimate_peer
        from swarm.learning.estimate_report import describe_estimate
        from swarm.pipeline import describe_stages

        device = "cpu" if config.train.device == "cpu" else "cuda"
        checkpointing = config.train.activation_checkpointing
        for line in describe_estimate(estimate_peer(config, device), checkpointing):
            typer.echo(line)
        for line in describe_stages(config, device):  # pipelined runs: what each stage peer needs
            typer.echo(line)
    if limits != [None, None]:
        _check_fit(config, *limits)


def _check_fit(config: RunConfig, device_bytes: int | None, host_bytes: int | None) -> None:
    """Print whether one peer fits the machine; exit 1 if it does not."""
    from swarm.learning.estimate import estimate_peer
    from swarm.learning.fit import describe_fit, fit_peer

    device = "cpu" if config.train.device == "cpu" else "cuda"
    fit = fit_peer(config, estimate_peer(config, device), device_bytes, host_bytes)
    for line in describe_fit(fit, device_bytes, host_bytes):
        typer.echo(line)
    if not fit.fits:
        raise typer.Exit(1)


_KEY_FILE_HELP = "A private swarm's key file (as network.swarm_key_file; or set SWARM_KEY)."


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
    swarm_key_file: Path | None = typer.Option(
        None, "--swarm-key-file", help=_KEY_FILE_HELP, show_default=False
    ),
) -> None:
    """Fetch the swarm's published run config, verify its hash, write it (exit 2 if none is published).

    A private swarm answers only a peer with its key: ``--swarm-key-file``, the environment's
    ``SWARM_NETWORK__SWARM_KEY_FILE`` or ``SWARM_KEY``, exactly as for `swarm join`.
    """
    keyed = [] if swarm_key_file is None else [f"network.swarm_key_file={json.dumps(str(swarm_key_file))}"]
    base = common.load_run_config(None, keyed)
    network = common.resolve_network(base, common.NetworkFlags(initial_peers=initial_peers))
    view = published_view(network, base, run_id, wait_s=0.0)
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


PUBLISHED_CONFIG_WAIT_S = 10.0
"""How long `swarm join` and `swarm monitor` without ``--config`` look for the swarm's published config.
A bootstrap publishes it before it prints its join line, so this only covers a swarm still starting."""
LOOK_AGAIN_S = 1.0
MAX_KEYS_LISTED = 40


def load_peer_config(
    path: Path | None, overrides: Sequence[str], flags: common.NetworkFlags, *, check: bool = False
) -> tuple[RunConfig, NetworkOptions]:
    """The run config of `swarm join` or `swarm monitor`, and its network options.

    A ``--config`` file (or, without initial peers, the defaults) is used as always. With initial peers
    and no file, the config is the one the swarm publishes (signed: hivemind's signature validator drops
    a forged record; and its hash checked, swarm/membership/_run_config.py) under this user's
    ``SWARM_*`` environment and ``--set`` overrides: exactly what `swarm config pull` would write and
    ``--config`` then load. Exits 2, saying to pass ``--config``, when none is published in time; never
    falls back to the defaults, which would silently start or watch another run.

    With ``check`` (`swarm join`) a fetched config is also checked against the swarm, as
    ``peers._compat_check.check_swarm_config`` checks a file, on what the same probe saw: the caller
    need not look again.
    """
    config = common.load_run_config(path, overrides)
    network = common.resolve_network(config, flags)
    if path is not None or not network.initial_peers:
        return config, network
    asked = config.run.run_id if config.run.run_id != RunConfig().run.run_id else None  # --run-id, --set
    view = published_view(network, config, asked, PUBLISHED_CONFIG_WAIT_S)
    if view.published_yaml is None:
        common.fail(nothing_published(view, network, PUBLISHED_CONFIG_WAIT_S))
    published, config = load_published(view.published_yaml, overrides)
    for line in describe_published(published, config):
        typer.echo(line, err=True)
    if check:
        _refuse_incompatible(config, view)
    return config, common.resolve_network(config, flags)


def _refuse_incompatible(config: RunConfig, view: SwarmView) -> None:
    """Exit 2 listing every problem (say, a --set of a swarm-wide key) when ``config`` cannot train here."""
    from swarm.membership import compatibility_problems

    problems = compatibility_problems(config, view.published_yaml, view.members)
    for line in problems:
        typer.echo(f"error: {line}", err=True)
    if problems:
        raise typer.Exit(2)


def published_view(
    network: NetworkOptions, config: RunConfig, run_id: str | None, wait_s: float
) -> SwarmView:
    """What a short-lived probe sees of the swarm (peers/_compat_check.py), looking again every
    :data:`LOOK_AGAIN_S` for up to ``wait_s`` while no valid config is published."""
    from peers._compat_check import look_at_swarm, open_probe

    deadline = time.monotonic() + wait_s
    with open_probe(network, config) as node:
        view = look_at_swarm(node, network, run_id)
        while view.published_yaml is None and time.monotonic() + LOOK_AGAIN_S < deadline:
            time.sleep(LOOK_AGAIN_S)  # nothing to wait on: the record appears in someone else's DHT node
            view = look_at_swarm(node, network, run_id)
    return view


def nothing_published(view: SwarmView, network: NetworkOptions, wait_s: float) -> str:
    where = ", ".join(network.initial_peers)
    if view.run_id:
        found = f"no valid run config is published for run {view.run_id!r} through {where}"
    else:
        found = (
            f"no run config is published through {where} (if several runs share this swarm, "
            "name one with --set run.run_id=ID)"
        )
    return (
        f"{found} within {wait_s:g}s; a record with a bad signature or hash does not count. Is the "
        "swarm's bootstrap up, and as recent as this version? Pass the run's config file with "
        "--config FILE (the organizer has it)"
    )


def load_published(text: str, overrides: Sequence[str]) -> tuple[RunConfig, RunConfig]:
    """The published config as published, and under this user's environment and overrides."""
    from swarm.config import load_config

    with tempfile.TemporaryDirectory(prefix="swarm-published-") as directory:
        file = Path(directory) / "published-run-config.yaml"
        file.write_text(text, encoding="utf-8")
        published = load_config(file, env={})  # the same text and loader the probe just validated it with
        return published, common.load_config_or_exit(file, overrides)


def describe_published(published: RunConfig, config: RunConfig) -> list[str]:
    """Lines saying which published config is used: its run, its hash, every key not at its default."""
    lines = [
        f"run config: the swarm's, for run {published.run.run_id!r}, config hash {published.config_hash()} "
        "(signature and hash checked)"
    ]
    ours, defaults = _flat(published), _flat(RunConfig())
    keys = sorted(key for key in ours.keys() | defaults.keys() if ours.get(key) != defaults.get(key))
    lines.append(f"run config: {len(keys)} key(s) differ from the defaults" + (":" if keys else ""))
    for key in keys[:MAX_KEYS_LISTED]:  # the publisher's text: JSON-escaped, and cut short
        per_peer = " (per peer: yours to --set)" if _is_per_peer(key) else ""
        value, default = _short(ours.get(key, "(not set)")), _short(defaults.get(key, "(not set)"))
        lines.append(f"  {_short(json.dumps(key)[1:-1])}: {value} (default {default}){per_peer}")
    if len(keys) > MAX_KEYS_LISTED:
        lines.append(f"  ... and {len(keys) - MAX_KEYS_LISTED} more (swarm config pull writes them all)")
    if config.config_hash() != published.config_hash():
        lines.append(f"run config: with your overrides its config hash is {config.config_hash()}")
    return lines


def _flat(config: RunConfig) -> dict[str, str]:
    """Dotted key -> canonical JSON of its value, for every leaf of the config."""
    flat: dict[str, str] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = json.dumps(value, sort_keys=True)

    walk(config.model_dump(mode="json"), "")
    return flat


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_per_peer(key: str) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:n]) in PER_PEER_KEYS for n in range(1, len(parts) + 1))
