"""`swarm data prepare|verify`: tokenize a run's text once into a directory every peer memory-maps.

The library side is :func:`swarm.learning.prepare_tokens` and :class:`swarm.learning.TokenFile`
(docs/training.md, "Prepared tokens"); torch is imported inside the commands.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from peers import _common as common

data_app = typer.Typer(
    help="Prepare training data: tokenize once, memory-map on every peer.", no_args_is_help=True
)


@data_app.command("prepare")
def prepare(
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    out: Path = typer.Option(
        ..., "--out", "-o", help="Directory to write the tokens to.", show_default=False
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=1, help="Stop after this many training tokens (a sample of a large stream)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out directory."),
) -> None:
    """Tokenize the config's data (data.source stdlib, files or hf; data.tokenizer) into --out.

    Peers then train on it with --set data.source=tokens --set data.paths=[OUT]: each memory-maps
    the token file, starts on its own shard, and resumes by offset.
    """
    cfg = common.load_run_config(config, set_)
    from swarm.learning import TokenFileError, prepare_tokens

    try:
        prepared = prepare_tokens(cfg.data, out, max_tokens=max_tokens, overwrite=overwrite)
    except (TokenFileError, ValueError, OSError, ImportError) as exc:
        common.fail(str(exc))
    typer.echo(
        f"wrote {out}: {prepared.train_tokens} training {prepared.unit}s, {len(prepared.eval)} held-out, "
        f"checksum {prepared.checksum}"
    )
    typer.echo(f"train on it with: --set data.source=tokens --set {shlex.quote(f'data.paths=[{out}]')}")


@data_app.command("verify")
def verify(
    directory: Path = typer.Argument(..., help="A directory `swarm data prepare` wrote.", show_default=False),
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
) -> None:
    """Check every chunk of a prepared directory against its index (exit 0), or name the problem (exit 2).

    The config (--config, --set) gives the tokenizer and eval_fraction the directory must match.
    """
    cfg = common.load_run_config(config, set_)
    from swarm.learning import TokenFile, TokenFileError, open_source

    data = cfg.data.model_copy(update={"source": "tokens", "paths": [str(directory)]})
    try:
        tokens = open_source(data)
        assert isinstance(tokens, TokenFile)
        tokens.verify()
    except (TokenFileError, OSError) as exc:
        common.fail(str(exc))
    typer.echo(
        f"OK: {directory}: {tokens.train_tokens} training {tokens.unit}s, {len(tokens.eval)} held-out, "
        f"checksum {tokens.checksum}"
    )
