"""Set-up helpers: the run id check, and which p2p daemon a replica of ours attaches to.

hivemind is imported inside the functions: importing it loads torch, and this package must stay light.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
"""What a run id may look like: it becomes part of every handler name."""


def check_run_id(run_id: str) -> None:
    """Raise ValueError unless ``run_id`` matches :data:`RUN_ID`."""
    if not RUN_ID.match(run_id):
        raise ValueError(f"run_id must match {RUN_ID.pattern}, got {run_id!r}")


def daemon_maddr(dht: DHT) -> Any:
    """The DHT's p2pd control address. We open our own client to it rather than ``dht.replicate_p2p()``,
    whose cached replica is bound to whichever event loop asked first and is shared with other users."""
    from hivemind.dht import DHT

    if not isinstance(dht, DHT):
        raise TypeError(f"dht must be a hivemind.DHT, got {type(dht).__name__}")
    return dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)


def source_maddr(source: DHT | P2P) -> Any:
    """The p2pd control address of a running ``hivemind.DHT`` or ``hivemind.p2p.P2P``."""
    from hivemind.p2p import P2P

    return source.daemon_listen_maddr if isinstance(source, P2P) else daemon_maddr(source)


async def replicate(maddr: Any) -> P2P:
    """A new P2P client of the daemon at ``maddr``, bound to the running event loop."""
    from hivemind.p2p import P2P

    return await P2P.replicate(maddr)
