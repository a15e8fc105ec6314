"""A swarm on loopback for the monitor's end-to-end tests: a `swarm bootstrap`, trainers that `swarm
join` it, and `swarm monitor` processes watching it, all on the same tiny run config (:data:`RUN`):
the monitor reports peers with another config as incompatible."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tests._processes import PeerProcess, join_address, swarm_cli
from tests.workers.tiny import BACKGROUND, ONE_THREAD, cli_sets, tiny

RUN = cli_sets(tiny(*BACKGROUND))
"""The ``--set`` arguments of every process: the tests' tiny trainer, in the background (stopped by
the test itself, its steps padded to 0.1 s)."""
SHARDED_RUN = cli_sets(tiny(*BACKGROUND, "run.member_shards=2", "averaging.partners=random"))
"""The same, with the members' records spread over two DHT keys (``run.member_shards``)."""

Spawn = Callable[..., PeerProcess]


def spawn_local_swarm(
    spawn: Spawn, entry: str, names: Iterable[str], run: Sequence[str] = RUN
) -> tuple[PeerProcess, str, list[PeerProcess]]:
    """Start a bootstrap named ``entry`` and a trainer joining through it per name in ``names``, each on
    one thread, all with the ``--set`` arguments ``run``; return the bootstrap, its multiaddr and the
    trainers (not waited for)."""
    boot = spawn(swarm_cli("bootstrap", "--public-name", entry, *run), env=ONE_THREAD)
    maddr = join_address(boot)
    joiners = [
        spawn(swarm_cli("join", "--initial-peers", maddr, "--public-name", name, *run), env=ONE_THREAD)
        for name in names
    ]
    return boot, maddr, joiners


def spawn_monitor(spawn: Spawn, maddr: str, *options: str, run: Sequence[str] = RUN) -> PeerProcess:
    """`swarm monitor` of the swarm behind ``maddr``, with ``options``."""
    return spawn(swarm_cli("monitor", "--initial-peers", maddr, *options, *run))


def spawn_live_monitor(spawn: Spawn, maddr: str, *options: str, run: Sequence[str] = RUN) -> PeerProcess:
    """`swarm monitor` of the swarm behind ``maddr`` that prints a JSON line per refresh, every second;
    with ``options`` (its sinks)."""
    live = (*options, "--format", "jsonl", "--set", "monitor.refresh_s=1")
    return spawn_monitor(spawn, maddr, *live, run=run)
