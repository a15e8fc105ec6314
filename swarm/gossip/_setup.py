"""Constructor helpers: parameter checks and the DHT's daemon address."""

from __future__ import annotations

import re
from typing import Any

RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def daemon_maddr(dht: object) -> Any:
    """The DHT's p2pd control address. We open our own client to it rather than ``dht.replicate_p2p()``,
    whose cached replica is bound to whichever event loop asked first and is shared with other users."""
    from hivemind.dht import DHT

    if not isinstance(dht, DHT):
        raise TypeError(f"dht must be a hivemind.DHT, got {type(dht).__name__}")
    return dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)


def check_params(
    run_id: str,
    dht: object | None,
    p2p_factory: object | None,
    chunk_bytes: int,
    exchange_timeout_s: float,
    chunk_timeout_s: float,
    max_attempts: int,
) -> None:
    if not RUN_ID.match(run_id):
        raise ValueError(f"run_id must match {RUN_ID.pattern}, got {run_id!r}")
    if (dht is None) == (p2p_factory is None):
        raise ValueError("give exactly one of dht= or p2p_factory=")
    if chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes must be at least 4096, got {chunk_bytes}")
    if exchange_timeout_s <= 0 or chunk_timeout_s <= 0:
        raise ValueError("timeouts must be positive")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
