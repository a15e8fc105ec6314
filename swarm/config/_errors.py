"""The one error type config loading raises."""

from __future__ import annotations

from collections.abc import Iterable

from swarm._errors import SwarmError


class ConfigError(SwarmError, ValueError):
    """A run config could not be loaded.

    ``errors`` holds one human-readable line per problem, each naming the dotted key (where there is
    one) and the source it came from, so that a person can fix every problem in one pass.
    ``str(error)`` is all the lines joined by newlines.
    """

    def __init__(self, errors: str | Iterable[str]) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        if not self.errors:
            raise ValueError("ConfigError needs at least one error line")
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)
