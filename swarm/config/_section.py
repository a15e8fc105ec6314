"""The base of every config section, and the error a check relating two keys raises."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


def cross_field(other: str, message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError("cross_field", message, {"other": other, **context})


class Section(BaseModel):
    """Strict about unknown keys and non-finite numbers; re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)
