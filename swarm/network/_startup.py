"""How a program wants the network started, set before anything heavy is imported.

A program with a terminal (``swarm bootstrap``, ``join``, ``monitor``...) calls
:func:`start_shm_manager_first`; :func:`swarm.network.start_dht` then starts torch's shared-memory
manager before the DHT, with SIGINT and SIGTERM blocked, so that a Ctrl+C during start-up cannot kill
it half-started. Library users, tests among them, leave it to torch: in a long-lived process, whose own
cleanups may stop that manager, it is started as torch needs it.
"""

from __future__ import annotations

_SHM_MANAGER_FIRST = [False]


def start_shm_manager_first() -> None:
    _SHM_MANAGER_FIRST[0] = True


def shm_manager_first() -> bool:
    return _SHM_MANAGER_FIRST[0]
