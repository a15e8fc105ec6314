"""Reading the three non-default sources: a YAML file, SWARM_* environment variables, --set flags.

Each source yields values keyed by a path of keys (``("train", "lr")``) together with a label of
where the value came from (``configs/x.yaml:12``, ``environment variable SWARM_TRAIN__LR``,
``--set train.lr``), so that validation errors can point a person at the line to fix. Problems that
stop a value from being read at all are collected as error lines rather than raised one by one.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml

from swarm.config._schema import RunConfig

Key = str | int
Loc = tuple[Key, ...]

ENV_PREFIX = "SWARM_"
ENV_SEPARATOR = "__"

ENV_ALLOWLIST: frozenset[str] = frozenset(
    {
        "SWARM_HOME",  # where peers keep identities, checkpoints and logs by default
        "SWARM_KEY",  # the secret key of a private swarm (swarm.network.load_swarm_key), never a config value
        "SWARM_LOG_LEVEL",  # logging verbosity of the peers/ programs
        "SWARM_TORCH_SPEC",  # which torch wheel scripts/setup.sh installs
    }
)
"""``SWARM_*`` environment variables that are not config keys and so are not errors."""

DEFAULT_SWARM_HOME = "~/.swarm"


def swarm_home(env: Mapping[str, str] | None = None) -> Path:
    """Where peers keep what they write by default (checkpoints, identities): ``$SWARM_HOME``, else
    ``~/.swarm``; ``~`` expanded. ``env=None`` reads ``os.environ``."""
    value = (os.environ if env is None else env).get("SWARM_HOME") or DEFAULT_SWARM_HOME
    return Path(value).expanduser()


MAX_YAML_NODES = 20_000
"""Most YAML nodes (scalars, mappings, sequences) one config may hold; a resolved config has about 300."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses anchors and aliases and stops after :data:`MAX_YAML_NODES` nodes.

    Configs are also read from untrusted peers (a published run config), and aliases let a few hundred
    bytes expand into billions of nodes (an "alias bomb"). A config never needs them; merge keys with an
    inline mapping (``<<: {lr: 1}``) still work.
    """

    def __init__(self, stream: str, max_nodes: int = MAX_YAML_NODES) -> None:
        super().__init__(stream)
        self._nodes_left = max_nodes
        self._max_nodes = max_nodes

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()
        mark: Any = event.start_mark
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not allowed in a config", mark
            )
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise yaml.composer.ComposerError(
                None, None, f"YAML anchors (&{anchor}) are not allowed in a config", mark
            )
        self._nodes_left -= 1
        if self._nodes_left < 0:
            raise yaml.composer.ComposerError(
                None, None, f"more than {self._max_nodes} YAML nodes; not a run config", mark
            )
        return super().compose_node(parent, index)


def load_yaml_text(text: str) -> Any:
    """Parse YAML ``text`` with :class:`BoundedLoader`; raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=BoundedLoader)  # a SafeLoader subclass


@dataclass
class Source:
    """Values read from one source, with the label of every key's origin."""

    values: list[tuple[Loc, Any, str]] = field(default_factory=list)
    origins: dict[Loc, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def read_yaml_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Source]:
    """Parse a YAML config file; origins map every key path to ``file:line`` of that key."""
    label = os.fspath(path)
    source = Source()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        source.errors.append(f"{label}: config file not found")
        return {}, source
    except IsADirectoryError:
        source.errors.append(f"{label}: is a directory, expected a YAML config file")
        return {}, source
    except (OSError, UnicodeDecodeError) as exc:
        source.errors.append(f"{label}: cannot read config file: {exc}")
        return {}, source

    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark else label
        source.errors.append(f"{where}: invalid YAML: {exc.problem or exc.context}")
        return {}, source
    except yaml.YAMLError as exc:
        source.errors.append(f"{label}: invalid YAML: {exc}")
        return {}, source
    finally:
        loader.dispose()

    if node is None or data is None:
        return {}, source
    if not isinstance(data, dict):
        line = node.start_mark.line + 1
        source.errors.append(
            f"{label}:{line}: the top level must be a mapping of sections (run:, train:, ...), "
            f"not a {type(data).__name__}"
        )
        return {}, source
    _walk(node, (), label, source, set())
    return _string_keys_only(data, {}), source


_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _walk(node: yaml.Node, loc: Loc, label: str, source: Source, seen: set[int]) -> None:
    """Record ``file:line`` for each mapping key and sequence item; flag duplicate or non-string keys."""
    if id(node) in seen:  # an alias: its lines were recorded where the anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR_TAG:
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else "a collection"
                source.errors.append(
                    f"{label}:{line}: {dotted(loc) or 'top level'}: key {shown!r} is not a string; quote it"
                )
                continue
            key = key_node.value
            child = (*loc, key)
            if key in first_line:
                source.errors.append(
                    f"{label}:{line}: {dotted(child)}: duplicate key (first set at line {first_line[key]})"
                )
                continue
            first_line[key] = line
            source.origins[child] = f"{label}:{line}"
            _walk(value_node, child, label, source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*loc, index)
            source.origins[child] = f"{label}:{item.start_mark.line + 1}"
            _walk(item, child, label, source, seen)


def _string_keys_only(value: Any, memo: dict[int, Any]) -> Any:
    """Drop non-string keys, already reported by ``_walk`` with their line, so they are not reported twice."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, dict):
        cleaned: dict[str, Any] = {}
        memo[id(value)] = cleaned
        cleaned.update((k, _string_keys_only(v, memo)) for k, v in value.items() if isinstance(k, str))
        return cleaned
    if isinstance(value, list):
        items: list[Any] = []
        memo[id(value)] = items
        items.extend(_string_keys_only(item, memo) for item in value)
        return items
    return value


def read_env(env: Mapping[str, str]) -> Source:
    """Config values from ``SWARM_<SECTION>__<KEY>`` variables (case of the key part is ignored)."""
    source = Source()
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in ENV_ALLOWLIST:
            continue
        label = f"environment variable {name}"
        parts = name[len(ENV_PREFIX) :].split(ENV_SEPARATOR)
        if len(parts) < 2 or not all(parts):
            allowed = ", ".join(sorted(ENV_ALLOWLIST))
            source.errors.append(
                f"{label}: not a config key; config variables are named SWARM_<SECTION>__<KEY> "
                f"(e.g. SWARM_TRAIN__LR), and the only other SWARM_ variables allowed are {allowed}"
            )
            continue
        _add_value(source, tuple(part.lower() for part in parts), env[name], label)
    return source


def read_overrides(overrides: Iterable[str]) -> Source:
    """Config values from ``--set section.key=value`` flags; a later flag wins over an earlier one."""
    source = Source()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep:
            source.errors.append(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. --set train.lr=1e-3")
            continue
        if not all(parts):
            source.errors.append(f"--set {item!r}: invalid key {key!r}; expected SECTION.KEY=VALUE")
            continue
        _add_value(source, tuple(parts), raw, f"--set {key}")
    return source


def _add_value(source: Source, loc: Loc, raw: str, label: str) -> None:
    try:
        parsed = load_yaml_text(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        source.errors.append(f"{label}: {dotted(loc)}: value {raw!r} is not valid YAML: {problem}")
        return
    source.values.append((loc, _adapt_to_field(loc, parsed, raw), label))


def _adapt_to_field(loc: Loc, parsed: Any, raw: str) -> Any:
    """Undo YAML's guesses that a person typing a flag or variable would not expect.

    A string field keeps the text as typed (``run.run_id=0x10`` stays ``"0x10"``, not ``16``), and a
    list field given one bare value gets a one-element list (``network.initial_peers=/ip4/...``).
    """
    annotation = _field_annotation(loc)
    if annotation is None:
        return parsed
    if _accepts(annotation, str) and parsed is not None and not isinstance(parsed, str | list | dict):
        return raw
    if _accepts(annotation, list) and isinstance(parsed, str):
        return [parsed]
    return parsed


def _field_annotation(loc: Loc) -> Any:
    if len(loc) != 2:
        return None
    section = RunConfig.model_fields.get(str(loc[0]))
    if section is None or not isinstance(section.annotation, type):
        return None
    field_info = section.annotation.model_fields.get(str(loc[1]))
    return None if field_info is None else field_info.annotation


def _accepts(annotation: Any, kind: type) -> bool:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_accepts(arg, kind) for arg in get_args(annotation) if arg is not type(None))
    if kind is list:
        return origin is list
    return annotation is kind


def dotted(loc: Loc) -> str:
    """``("network", "initial_peers", 0)`` -> ``network.initial_peers[0]``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
