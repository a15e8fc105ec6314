"""The base of every exception the swarm library raises (no imports: safe to load from anywhere)."""


class SwarmError(Exception):
    """Base class of the library's own errors.

    Each subclass keeps the built-in base it had before (``ConfigError`` is still a ``ValueError``,
    ``NetworkError`` a ``RuntimeError``), so ``except SwarmError`` catches everything the library
    itself raises while existing ``except ValueError`` handlers work as before.
    """
