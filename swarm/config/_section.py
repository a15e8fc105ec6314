"""The base of every config section, the per-peer marker, and the error a check relating two keys raises."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError, PydanticUndefined

PER_PEER: JsonDict = {"per_peer": True}
"""``json_schema_extra`` of a field (or of a whole section in ``RunConfig``) that each peer may set
for its own machine or link: it is left out of the config hash. :func:`per_peer_field` sets it."""


def per_peer_field(default: Any = PydanticUndefined, **kwargs: Any) -> Any:
    """``Field(default, **kwargs)`` marked :data:`PER_PEER`."""
    return Field(default, json_schema_extra=PER_PEER, **kwargs)


def is_per_peer(field: FieldInfo) -> bool:
    """Whether ``field`` carries the :data:`PER_PEER` marker."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("per_peer") is True


def cross_field(other: str, message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError("cross_field", message, {"other": other, **context})


class Section(BaseModel):
    """Strict about unknown keys and non-finite numbers; re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)
