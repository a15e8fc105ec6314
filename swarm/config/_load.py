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
        errors += file_source.errors or _empty_file_errors(path, tree)
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


def _empty_file_errors(path: str | os.PathLike[str], tree: dict[str, Any]) -> list[str]:
    """A config file without a single section is a mistake (the wrong file, or one not saved yet), not
    a request for the defaults: name it. A section left empty still means its defaults."""
    if tree:
        return []
    return [
        f"{os.fspath(path)}: the file holds no config (it is empty or all comments); a run config has at "
        "least one section, e.g. 'run:' with 'run_id: my-run' under it"
    ]


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
    kind = error["type"]
    if kind == "section_key":  # a section's check that names one of its keys
        loc, error = (*loc, error["ctx"]["key"]), {**error, "input": error["ctx"]["value"]}
    origin = _origin(loc, tree, origins)
    if kind == "extra_forbidden":
        message = _unknown_key_message(loc)
    else:
        message = f"{error['msg']} (got {_short(error['input'])})"
    if kind == "cross_field":
        other = (*loc[:-1], error["ctx"]["other"])
        origin += f"; {dotted(other)} from {_origin(other, tree, origins)}"
    return f"{dotted(loc) or 'top level'}: {message} [{origin}]"


_MODELS_ONLY = "every exchange averages the pair's models, which keeps their anchors together"
RETIRED_KEYS: dict[str, str] = {
    "averaging.exchange": _MODELS_ONLY,
    "averaging.anchor_pull": _MODELS_ONLY,
    "averaging.param_sync_every": _MODELS_ONLY + ": there is no separate anchor exchange",
    "averaging.max_drift": _MODELS_ONLY + ": there is no separate anchor exchange",
}
"""Keys that were removed, with why: a config that still sets one is told to delete it."""


def _unknown_key_message(loc: Loc) -> str:
    moved = MOVED_KEYS.get(dotted(loc))
    if moved is not None:
        return f"unknown key: moved to {moved}"
    retired = RETIRED_KEYS.get(dotted(loc))
    if retired is not None:
        return f"removed key: {retired} (docs/gossip.md); delete it"
    model: type[BaseModel] = RunConfig
    if len(loc) == 2:
        field = RunConfig.model_fields.get(str(loc[0]))
        model = field.annotation if field is not None else RunConfig  # type: ignore[assignment]
    what = "section" if len(loc) == 1 else "key"
    valid = list(model.model_fields)
    close = _close_name(str(loc[-1]), valid) or _close_name(str(loc[-1]), list(_all_keys()), dotted=True)
    hint = f"did you mean {close!r}?" if close else "valid: " + ", ".join(valid)
    return f"unknown {what} ({hint})"


def _all_keys() -> dict[str, str]:
    """Every key of every section, dotted, by its bare name (the first section's, if two share one)."""
    keys: dict[str, str] = {}
    for section, field in RunConfig.model_fields.items():
        inner = field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            for key in inner.model_fields:
                keys.setdefault(key, f"{section}.{key}")
    return keys


def _close_name(typed: str, valid: list[str], *, dotted: bool = False) -> str | None:
    """The valid name ``typed`` was most likely meant to be: the same name in another case, a close
    spelling (difflib), a name it abbreviates or is abbreviated by (``learning_rate``: ``lr``), or one
    it is part of (``port``: ``prometheus_port``). With ``dotted``, ``valid`` are bare key names of
    other sections and the answer is the dotted key (a key put in the wrong section or at the top)."""
    lowered = {name.lower(): name for name in valid}
    key = typed.lower().replace("-", "_")
    found = lowered.get(key)
    if found is None:
        close = difflib.get_close_matches(key, list(lowered), n=1)
        found = lowered[close[0]] if close else None
    if found is None:
        initials = {_initials(name): name for name in reversed(valid)}
        found = initials.get(key) or next((n for n in valid if n == _initials(key)), None)
    if found is None and len(key) >= 4:
        found = next((name for name in valid if key in name.lower()), None)
    if found is None or not dotted:
        return found
    return _all_keys()[found]


def _initials(name: str) -> str:
    """``learning_rate`` -> ``lr``: the first letter of each underscore-separated word."""
    return "".join(word[0] for word in name.lower().split("_") if word)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
