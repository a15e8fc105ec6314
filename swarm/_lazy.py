"""Lazy re-exports (PEP 562) for the package ``__init__`` files that keep ``import swarm...`` light."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def load_export(package: str, exports: Mapping[str, str], name: str, namespace: dict[str, Any]) -> Any:
    """The body of ``package``'s module ``__getattr__``: import ``name`` from the module ``exports``
    names for it and cache it in ``namespace`` (the package's ``globals()``), so it loads only once."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module '{package}' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value
