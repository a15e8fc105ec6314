"""The exported directory: write it atomically, read it back; and a model rebuilt from a checkpoint.

Every export is a ``transformers`` model directory, so ``AutoModelForCausalLM.from_pretrained(DIR)``
loads it and ``pipeline("text-generation", model=DIR)`` samples from it::

    DIR/config.json          the transformers config: GPT-2 for the built-in GPT (swarm/export/_gpt2.py),
                             the model's own for model.kind hf
    DIR/model.safetensors    the weights, under the transformers names (a tied head stored once)
    DIR/generation_config.json
                             for the built-in GPT: ``max_length`` = ``n_positions``, so that generation
                             stops when the context is full instead of failing past it
    DIR/tokenizer.json, tokenizer_config.json
                             the run's data.tokenizer; for byte-level runs (vocab_size 256) a byte
                             tokenizer (swarm/export/_byte_tokenizer.py); none otherwise
    DIR/swarm.json           {"format", "kind", "model": <the run's model section>, "run_id",
                             "config_hash", "progress": {"round", "step", "samples"}}

Writing the built-in GPT needs only safetensors (transformers writes the tokenizer when installed).
Directories of the older layout (``swarm-export/1`` for the built-in GPT: ``model.safetensors`` under
the swarm model's names with the metadata in ``config.json``) still load with :func:`load_exported`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from torch import nn

from swarm._atomic import replace_directory, write_json_synced
from swarm._errors import SwarmError
from swarm._tokenizer import load_tokenizer
from swarm.config import ConfigError, ModelSection, RunConfig, load_config
from swarm.export._byte_tokenizer import BYTE_VOCAB, byte_tokenizer
from swarm.export._gpt2 import from_gpt2, generation_config, gpt2_config, to_gpt2
from swarm.learning import build_model
from swarm.state import CheckpointError, load_latest_checkpoint, read_checkpoint
from swarm.state.checkpoint import CONFIG_KEY

logger = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
SWARM_FILE = "swarm.json"
FORMAT = "swarm-export/2"
OLD_FORMAT = "swarm-export/1"


class ExportError(SwarmError):
    """The model cannot be exported or loaded: a bad checkpoint, another config, a bad directory."""


@dataclass
class ExportedModel:
    """A model together with what identifies it: its model config, run, config hash and progress."""

    model: nn.Module
    model_config: ModelSection
    run_id: str
    config_hash: str
    progress: dict[str, int]
    """``round``, ``step`` and ``samples`` (samples trained) of the state the weights come from."""
    tokenizer: Any = None
    """The run's ``transformers`` tokenizer (``data.tokenizer``), saved beside the model; None for bytes."""

    def metadata(self) -> dict[str, Any]:
        """What goes into ``swarm.json``."""
        return {
            "format": FORMAT,
            "kind": self.model_config.kind,
            "model": self.model_config.model_dump(mode="json"),
            "run_id": self.run_id,
            "config_hash": self.config_hash,
            "progress": dict(self.progress),
        }


def progress_counters(raw: Mapping[str, Any]) -> dict[str, int]:
    """``round``/``step``/``samples`` out of a checkpoint's progress or a state's meta (0 when absent)."""
    return {
        "round": int(raw.get("round", 0)),
        "step": int(raw.get("step", 0)),
        "samples": int(raw.get("samples_total", 0)),
    }


def run_tokenizer(config: RunConfig) -> Any:
    """The ``transformers`` tokenizer of ``config``'s ``data.tokenizer``, or None for byte-level runs."""
    return load_tokenizer(config.data.tokenizer).hf if config.data.tokenizer is not None else None


@dataclass
class CheckpointConfig:
    """The run config a model is rebuilt with, and where it came from (for the error that refuses a
    config of another hash)."""

    config: RunConfig
    origin: str
    hint: str = "leave out --config to use the checkpoint's own config, or pass the run's config file"


def read_trainer_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """A verified trainer checkpoint: a file, or a directory's newest valid one; ``(state, file)``."""
    source = Path(path).expanduser()
    if source.is_dir():
        found = load_latest_checkpoint(source)
        if found is None:
            raise ExportError(f"no valid checkpoint in {source}")
        return found
    if source.is_file():
        try:
            return read_checkpoint(source), source
        except (CheckpointError, OSError) as error:
            raise ExportError(f"{source}: {error}") from error
    raise ExportError(f"{source}: no such checkpoint file or directory")


def stored_config(
    state: Mapping[str, Any], source: Path, overrides: Sequence[str] = ()
) -> CheckpointConfig | None:
    """The run config the checkpoint carries (with ``overrides`` applied), None when it carries none
    (a checkpoint written before checkpoints carried it). The environment is not read: the stored
    config is the run's, whatever this shell sets."""
    text = state.get(CONFIG_KEY)
    if text is None:
        return None
    if not isinstance(text, str):
        raise ExportError(f"checkpoint {source}: its stored config is not text")
    with tempfile.TemporaryDirectory(prefix="swarm-config-") as directory:
        path = Path(directory) / "checkpoint.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            config = load_config(path, overrides=tuple(overrides), env={})
        except ConfigError as error:
            details = "; ".join(line.replace(str(path), "stored config") for line in error.errors)
            raise ExportError(f"checkpoint {source}: its stored config does not load: {details}") from None
    with_sets = f" with {' '.join(f'--set {o}' for o in overrides)}" if overrides else ""
    return CheckpointConfig(
        config,
        f"the config stored in the checkpoint{with_sets}",
        "leave out the --set overrides that change the run",
    )


def model_from_checkpoint(
    path: str | os.PathLike[str],
    config: RunConfig | None = None,
    *,
    origin: str = "the given config",
    overrides: Sequence[str] = (),
) -> ExportedModel:
    """Rebuild the model of a trainer checkpoint: a file, or a directory's newest valid checkpoint.

    The checkpoint is verified (:func:`swarm.state.read_checkpoint`). The model is rebuilt with
    ``config`` when given (``origin`` says where it came from, for the error), which must have the
    checkpoint's config hash; else with the run config the checkpoint carries, ``overrides``
    (``section.key=value``) applied. A checkpoint written before checkpoints carried their config
    needs ``config``, unless its run used the defaults. Raises :class:`ExportError`.
    """
    state, source = read_trainer_checkpoint(path)
    given = None if config is None else CheckpointConfig(config, origin)
    chosen = resolve_config(state, source, given, overrides)
    return _rebuild(state, source, chosen.config)


def resolve_config(
    state: Mapping[str, Any], source: Path, given: CheckpointConfig | None, overrides: Sequence[str] = ()
) -> CheckpointConfig:
    """The config to rebuild the checkpoint's model with: ``given`` when there is one, else the one
    the checkpoint carries (``overrides`` applied), else the defaults (``overrides`` applied); refused
    unless it has the config hash the checkpoint records."""
    recorded = state.get("config_hash")
    if given is None:
        given = stored_config(state, source, overrides)
        if given is None:
            given = _default_config(overrides)
            if given.config.config_hash() != recorded:
                raise ExportError(
                    f"checkpoint {source} carries no run config (it was written before checkpoints did) "
                    f"and its config hash {recorded!r} is not the default config's: pass the run's config "
                    "file with --config (and the same --set overrides)"
                )
    expected = given.config.config_hash()
    if recorded != expected:
        raise ExportError(
            f"checkpoint {source} belongs to config hash {recorded!r} (recorded in the checkpoint), but "
            f"{given.origin} has {expected!r}: {given.hint}"
        )
    return given


def _default_config(overrides: Sequence[str]) -> CheckpointConfig:
    try:
        config = load_config(None, overrides=tuple(overrides), env={})
    except ConfigError as error:
        raise ExportError("; ".join(error.errors)) from None
    return CheckpointConfig(config, "the default config")


def _rebuild(state: Mapping[str, Any], source: Path, config: RunConfig) -> ExportedModel:
    weights = state.get("model")
    if not isinstance(weights, dict):
        raise ExportError(f"checkpoint {source} holds no model state (a pipeline stage's checkpoint?)")
    model = build_model(config.model, config.run.seed)
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise ExportError(f"checkpoint {source} does not fit the configured model: {error}") from error
    progress = state.get("progress")
    return ExportedModel(
        model.eval(),
        config.model,
        config.run.run_id,
        config.config_hash(),
        progress_counters(progress if isinstance(progress, Mapping) else {}),
        run_tokenizer(config),
    )


def export_model(exported: ExportedModel, out: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``exported`` to the directory ``out`` (layout: module docstring) and return its path.

    Everything is written to a temporary directory beside ``out`` first, then renamed into place, so
    ``out`` is either the whole export or what it was before. An existing non-empty ``out`` is
    refused unless ``overwrite``.
    """
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ExportError(f"{target} exists and is not empty (overwrite it with --overwrite)")
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        if exported.model_config.kind == "hf":
            exported.model.inner.save_pretrained(temporary)  # an HFCausalLM
        else:
            from safetensors.torch import save_file

            save_file(to_gpt2(exported.model.state_dict()), str(temporary / MODEL_FILE), {"format": "pt"})
            write_json_synced(temporary / CONFIG_FILE, gpt2_config(exported.model_config))
            write_json_synced(temporary / GENERATION_FILE, generation_config(exported.model_config))
        _save_tokenizer(exported, temporary)
        write_json_synced(temporary / SWARM_FILE, exported.metadata())
        _normal_modes(temporary, like=temporary / SWARM_FILE)
        replace_directory(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return target


def _normal_modes(directory: Path, like: Path) -> None:
    """Give every file in ``directory`` the mode of ``like`` (a file opened the usual way: 0644 under
    the usual umask). safetensors writes its files 0600, and an exported model is meant to be shared."""
    mode = stat.S_IMODE(like.stat().st_mode)
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def _save_tokenizer(exported: ExportedModel, directory: Path) -> None:
    """The run's tokenizer, or the byte tokenizer for a byte-level model; none without transformers."""
    tokenizer = exported.tokenizer
    if tokenizer is None and exported.model_config.vocab_size == BYTE_VOCAB:
        try:
            tokenizer = byte_tokenizer(exported.model_config.block_size)
        except ImportError:
            logger.warning("transformers is not installed: the export has no tokenizer (ids are bytes)")
            return
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def load_exported(directory: str | os.PathLike[str]) -> ExportedModel:
    """Load what :func:`export_model` wrote (in eval mode, on the CPU); raises :class:`ExportError`.

    The built-in GPT comes back as :class:`~swarm.learning.GPT` (for ``swarm generate``), from either
    layout; an hf model as :class:`~swarm.learning.model.HFCausalLM` (needs transformers).
    """
    root = Path(directory)
    meta_path = root / SWARM_FILE if (root / SWARM_FILE).is_file() else root / CONFIG_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ExportError(f"{root} is not an exported model: {meta_path.name}: {error}") from error
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, OLD_FORMAT):
        raise ExportError(f"{meta_path}: not a swarm export (format {FORMAT!r} or {OLD_FORMAT!r} expected)")
    try:
        section = ModelSection.model_validate(meta.get("model"))
    except ValidationError as error:
        raise ExportError(f"{meta_path}: bad model section: {error}") from error
    model: nn.Module
    if section.kind == "hf":
        from transformers import AutoModelForCausalLM

        from swarm.learning.model import HFCausalLM

        model = HFCausalLM(AutoModelForCausalLM.from_pretrained(root))
    else:
        model = _load_gpt(root, section, gpt2_layout=meta_path.name == SWARM_FILE)
    progress = meta.get("progress")
    return ExportedModel(
        model.eval(),
        section,
        str(meta.get("run_id", "")),
        str(meta.get("config_hash", "")),
        {k: int(v) for k, v in progress.items()} if isinstance(progress, dict) else {},
    )


def _load_gpt(root: Path, section: ModelSection, *, gpt2_layout: bool) -> nn.Module:
    """The built-in GPT of ``section`` with the weights of ``root/model.safetensors``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, load_model

    model = build_model(section, seed=0)
    path = root / MODEL_FILE
    try:
        if gpt2_layout:
            model.load_state_dict(from_gpt2(load_file(str(path))))
        else:
            load_model(model, str(path))
    except (OSError, RuntimeError, ValueError, SafetensorError) as error:
        raise ExportError(f"{path}: {error}") from error
    return model
