"""`swarm export` and `swarm generate`: get the trained model out of a run (docs/export.md).

The library side is :mod:`swarm.export`; torch is imported inside the commands, so that merely
registering them keeps `swarm config` light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from peers import _common as common
from peers._signals import shutdown_on_signals
from swarm.config import RunConfig

if TYPE_CHECKING:
    from swarm.export import ExportedModel

CHECKPOINT_OPTION = typer.Option(
    None,
    "--checkpoint",
    help="A trainer checkpoint file, or a checkpoint directory (its newest valid checkpoint).",
    show_default=False,
)
CONFIG_OPTION = typer.Option(
    None,
    "--config",
    "-c",
    help="Run config YAML file. Omitted: the one a checkpoint carries (--checkpoint; its config hash must "
    "match when given), the defaults with --initial-peers.",
)


def export(
    checkpoint: Path | None = CHECKPOINT_OPTION,
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write the model to.", show_default=False),
    config: Path | None = CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    initial_peers: list[str] | None = common.INITIAL_PEERS_OPTION,
    wait: float = typer.Option(
        30.0, "--wait", min=0.0, help="With --initial-peers: seconds to wait for a peer announcing a state."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out directory."),
) -> None:
    """Write the trained model to a directory as a transformers model, with its tokenizer.

    The model comes from a checkpoint (--checkpoint), which carries the run's config, or from the live
    swarm's state (--initial-peers) with the run's config (--config, --set). A --config whose hash is
    not the checkpoint's is refused; --set alone applies to the checkpoint's config.
    The built-in GPT is written as the GPT-2 it is, hf models (model.kind hf) with save_pretrained:
    AutoModelForCausalLM.from_pretrained(DIR) loads either.
    """
    if (checkpoint is None) == (not initial_peers):
        common.fail("give exactly one of --checkpoint PATH and --initial-peers MADDR")
    from swarm.export import ExportError, export_model

    try:
        if checkpoint is not None:
            exported = _from_checkpoint(checkpoint, config, set_)
        else:
            exported = _download(common.load_run_config(config, set_), initial_peers or [], wait)
        path = export_model(exported, out, overwrite=overwrite)
    except (ExportError, ImportError) as exc:
        common.fail(str(exc))
    p = exported.progress
    typer.echo(
        f"wrote {path}: run {exported.run_id!r}, config hash {exported.config_hash}, "
        f"round {p['round']}, step {p['step']}, {p['samples']} samples"
    )


def _from_checkpoint(checkpoint: Path, config: Path | None, set_: list[str] | None) -> ExportedModel:
    """The checkpoint's model, rebuilt with its own config (``--set`` applied), or with ``--config``."""
    from swarm.export import model_from_checkpoint

    if config is None:
        return model_from_checkpoint(checkpoint, overrides=set_ or ())
    with_sets = "".join(f" --set {o}" for o in set_ or ())
    given = common.load_run_config(config, set_)
    return model_from_checkpoint(checkpoint, given, origin=f"--config {config}{with_sets}")


def _download(config: RunConfig, initial_peers: list[str], wait_s: float) -> ExportedModel:
    """Open a non-announcing node in client mode and take the swarm's state over."""
    from peers.monitor import observer_info
    from swarm.export import download_model

    network = common.resolve_network(
        config, common.NetworkFlags(initial_peers=initial_peers, client_mode=True)
    )
    node = common.open_node(network, observer_info(config), config, announce=False)
    with shutdown_on_signals() as stop, node:
        return download_model(node, config, wait_s=wait_s, stop=stop)


def generate(
    checkpoint: Path | None = CHECKPOINT_OPTION,
    model_dir: Path | None = typer.Option(
        None, "--model", help="An exported model directory (`swarm export --out`).", show_default=False
    ),
    config: Path | None = CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    prompt: str = typer.Option(..., "--prompt", "-p", help="Text to continue.", show_default=False),
    max_new_bytes: int = typer.Option(200, "--max-new-bytes", "-n", help="Bytes to generate."),
    temperature: float = typer.Option(0.8, "--temperature", help="Sampling temperature; 0: greedy."),
    top_k: int = typer.Option(50, "--top-k", help="Sample among the k most likely bytes; 0: all."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed: the same seed gives the same text."),
) -> None:
    """Print the prompt followed by text sampled from the byte-level GPT (model.kind gpt)."""
    if (checkpoint is None) == (model_dir is None):
        common.fail("give exactly one of --checkpoint PATH and --model DIR")
    if not prompt:
        common.fail("--prompt is empty: give some text to continue")
    if max_new_bytes < 1:
        common.fail(f"--max-new-bytes must be positive, got {max_new_bytes}")
    if temperature < 0:
        common.fail(f"--temperature must be >= 0, got {temperature}")
    if top_k < 0:
        common.fail(f"--top-k must be >= 0, got {top_k}")
    from swarm.export import ExportError, load_exported
    from swarm.export import generate as sample

    try:
        if checkpoint is not None:
            exported = _from_checkpoint(checkpoint, config, set_)
        else:
            exported = load_exported(model_dir or Path())
    except (ExportError, ImportError) as exc:
        common.fail(str(exc))
    section = exported.model_config
    if section.kind != "gpt":
        common.fail(f"generation supports model.kind gpt only, this model is {section.kind!r}")
    data = prompt.encode("utf-8")
    if len(data) > section.block_size:
        typer.echo(
            f"note: the prompt has {len(data)} bytes, more than block_size {section.block_size}: "
            f"the model sees its last {section.block_size}",
            err=True,
        )
    try:
        new = sample(
            exported.model, data, max_new_bytes, temperature=temperature, top_k=top_k or None, seed=seed
        )
    except ValueError as exc:
        common.fail(str(exc))
    typer.echo((data + new).decode("utf-8", errors="replace"))
