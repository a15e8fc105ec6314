"""Merging the sources in precedence order and turning validation errors into located messages."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from swarm.config._errors import ConfigError
from swarm.config._schema import MOVED_KEYS, RunConfig
from swarm.config._sources import Loc, Source, dotted, read_env, read_overrides, read_yaml_file

DEFAULT_ORIGIN = "default value"


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> RunConfig:
    """Build a :class:`RunConfig` from defaults < YAML file < ``SWARM_*`` env < ``--set`` overrides.

    ``env=None`` reads ``os.environ``; pass ``{}`` to ignore the environment. Raises
    :class:`ConfigError` listing every problem found, each with its dotted key and source.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'section.key=value' strings, not one string")
    tree: dict[str, Any] = {}
    origins: dict[Loc, str] = {}
    errors: list[str] = []
    if path is not None:
        tree, file_source = read_yaml_file(path)
        origins.update(file_source.origins)
        errors += file_source.errors
    for source in (read_env(os.environ if env is None else env), read_overrides(overrides)):
        errors += source.errors
        _apply(tree, origins, source)
    try:
        config = RunConfig.model_validate(tree)
    except ValidationError as exc:
        errors += [_format(error, tree, origins) for error in exc.errors(include_url=False)]
    if errors:
        raise ConfigError(errors)
    return config


def _apply(tree: dict[str, Any], origins: dict[Loc, str], source: Source) -> None:
    """Set each value at its path, replacing whatever a lower-precedence source put there."""
    for loc, value, label in source.values:
        node: dict[Any, Any] = tree
        for depth, key in enumerate(loc[:-1], start=1):
            if not isinstance(node.get(key), dict):
                node[key] = {}
                origins[loc[:depth]] = label
            node = node[key]
        node[loc[-1]] = value
        for known in [known for known in origins if known[: len(loc)] == loc]:
            del origins[known]
        origins[loc] = label


def _origin(loc: Loc, tree: Any, origins: dict[Loc, str]) -> str:
    """Label of the source that set ``loc``, or of the enclosing value it set; else the default."""
    node = tree
    for key in loc:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return DEFAULT_ORIGIN
    for depth in range(len(loc), 0, -1):
        if loc[:depth] in origins:
            return origins[loc[:depth]]
    return DEFAULT_ORIGIN


def _format(error: Any, tree: dict[str, Any], origins: dict[Loc, str]) -> str:
    loc: Loc = tuple(error["loc"])
    origin = _origin(loc, tree, origins)
    kind = error["type"]
    if kind == "extra_forbidden":
        message = _unknown_key_message(loc)
    else:
        message = f"{error['msg']} (got {_short(error['input'])})"
    if kind == "cross_field":
        other = (*loc[:-1], error["ctx"]["other"])
        origin += f"; {dotted(other)} from {_origin(other, tree, origins)}"
    return f"{dotted(loc) or 'top level'}: {message} [{origin}]"


def _unknown_key_message(loc: Loc) -> str:
    moved = MOVED_KEYS.get(dotted(loc))
    if moved is not None:
        return f"unknown key: moved to {moved}"
    model: type[BaseModel] = RunConfig
    if len(loc) == 2:
        field = RunConfig.model_fields.get(str(loc[0]))
        model = field.annotation if field is not None else RunConfig  # type: ignore[assignment]
    what = "section" if len(loc) == 1 else "key"
    valid = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "valid: " + ", ".join(valid)
    return f"unknown {what} ({hint})"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
