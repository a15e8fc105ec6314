"""Trainer processes for tests/test_malicious.py: honest peers, and attackers built from a test hook.

Each peer is a fork of a forkserver that has already imported torch, hivemind and the trainer (a
fresh interpreter per peer costs seconds of CPU on a 2-core machine), in its own process group so
that its DHT process and p2p daemon can be found (and, if they outlive a graceful stop, killed). An
attacker is an ordinary :class:`TrainingPeer` whose pseudo-gradient averager gets a tampering or
stalling channel (tests/_faults.py) patched in here: no attack code lives in the product.

Each peer also records the bans its averagers pronounce and the hard exchanges that count towards
them, as they happen (from the averagers' own "banning peer" and "suspicious partner" log records),
and reports them with its summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests._processes import reap_workers

CONTEXT = mp.get_context("forkserver")
# torch._dynamo too: torch imports it on a process's first optimizer, about 3 s of CPU per peer otherwise
CONTEXT.set_forkserver_preload(
    [
        "torch",
        "torch._dynamo",
        "hivemind",
        "swarm.trainer",
        "peers.join",
        "peers._common",
        "tests.workers.malicious",
    ]
)

NamedTensors = list[tuple[str, torch.Tensor]]


def scaled(named: NamedTensors) -> NamedTensors:
    """The attacker's own pseudo-gradient, 100 times larger."""
    return [(name, t * 100.0) for name, t in named]


def random_update(named: NamedTensors) -> NamedTensors:
    """Standard normal noise in place of the pseudo-gradient (far larger than honest updates)."""
    return [(name, torch.randn_like(t)) for name, t in named]


def negated(named: NamedTensors) -> NamedTensors:
    """The attacker's own pseudo-gradient, negated: it undoes its partner's round."""
    return [(name, -t) for name, t in named]


ATTACKS = {"scaled": scaled, "random": random_update, "claim": negated}

CLAIMED_WEIGHT = 1e29
"""The weight (samples) the "claim" attacker states in every HELLO: below the protocol's cap of 1e30."""


def _claim_weight(averager: Any) -> None:
    """Make every offer of ``averager`` state :data:`CLAIMED_WEIGHT` samples (issue 28, finding 1)."""
    offerer = averager._offerer
    original = offerer.offer

    def claimed() -> Any:
        offer = original()
        return None if offer is None else dataclasses.replace(offer, weight=CLAIMED_WEIGHT)

    offerer.offer = claimed


def _install_attack(peer: Any, attack: str) -> None:
    """Patch the attack into the peer's pseudo-gradient averager: a tamper of what it sends ("claim"
    also states a huge weight), or "stall": it stops after its first frame of every exchange, served
    or initiated, and holds the stream open (issue 28, finding 9)."""
    from tests._faults import stalling, tampering

    averager = peer.backend.models
    if attack == "stall":
        averager._wrap_channel = stalling(1)
    else:
        averager._wrap_channel = tampering(ATTACKS[attack], averager._spec.codec)
    if attack == "claim":
        _claim_weight(averager)


def _log_clips() -> None:
    """``MALICIOUS_DEBUG=1``: log the robust clip's verdict on every exchange's pair of tensors."""
    import swarm.gossip._exchange as exchange

    original = exchange.clip_stats

    def logged(norms: Any, policy: Any, reference: float, weights: tuple[float, float], own: Any) -> Any:
        stats = original(norms, policy, reference, weights, own)
        logging.getLogger("clip").warning("w=%.0f v=%.0f %s", weights[0], weights[1], stats)
        return stats

    exchange.clip_stats = logged


class BanLog(logging.Handler):
    """Collects what the gossip averagers log against partners: the "banning peer" records as
    ``bans`` (monotonic time, peer, reason), and the hard exchanges that count towards a ban (the
    reputation's "suspicious partner" records) as ``suspicions`` (monotonic time, peer)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.bans: list[tuple[float, str, str]] = []
        self.suspicions: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith("swarm.gossip"):
            return
        message = str(record.msg)
        if message.startswith("banning peer"):
            peer, _duration, _strike, reason = record.args
            self.bans.append((time.monotonic(), str(peer), str(reason)))
        elif record.name == "swarm.gossip._reputation" and message.startswith("suspicious partner"):
            self.suspicions.append((time.monotonic(), str(record.args[0])))


def _wait_for_go(conn: Any, stop: threading.Event) -> str | None:
    """The summary path the test sends to start training, or None when stopped first."""
    while not stop.is_set():
        if conn.poll(0.2):
            return conn.recv()
    return None


def peer_main(
    conn: Any, overrides: Sequence[str], initial_peers: Sequence[str], attack: str | None, identity: str
) -> None:
    """Build a trainer, report its id and addresses, train on "go", write its summary, report "done"
    with the bans it pronounced. SIGTERM stops it cleanly at any point (closing its node and daemon)."""
    os.setpgid(0, 0)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    ban_log = BanLog()
    logging.getLogger("swarm").addHandler(ban_log)
    if os.environ.get("MALICIOUS_DEBUG"):
        _log_clips()
    from peers._signals import shutdown_on_signals
    from peers._trainer_output import write_summary
    from swarm.config import load_config
    from swarm.network import NetworkOptions
    from swarm.trainer import TrainingPeer

    peer = None
    with shutdown_on_signals() as stop:
        try:
            config = load_config(None, overrides=list(overrides), env={})
            network = NetworkOptions(
                initial_peers=list(initial_peers),
                identity_path=identity,
                startup_timeout_s=config.network.startup_timeout_s,
            )
            peer = TrainingPeer(config, network)
            if attack is not None:
                _install_attack(peer, attack)
            conn.send(("ready", peer.node.peer_id, peer.node.visible_maddrs()))
            summary_path = _wait_for_go(conn, stop)
            if summary_path is not None:
                started = time.monotonic()
                peer.run(stop)
                finished = time.monotonic()
                write_summary(peer, Path(summary_path))
                result = peer.join_result
                joined = {"donors": list(result.donors), "meta": result.meta, "digest": result.digest}
                report = {
                    "started": started,
                    "finished": finished,
                    "bans": ban_log.bans,
                    "suspicions": ban_log.suspicions,
                    "joined": joined,
                }
                conn.send(("done", report, None))
        except BaseException:
            conn.send(("error", traceback.format_exc(), None))
        finally:
            if peer is not None:
                peer.close()


@dataclass
class Swarm:
    """Trainers of one run, started and stopped together; ``attacks`` maps a peer's index to the
    attack it runs (an honest swarm has none).

    Peer ``i`` uses ``identities[i]``: its peer id, and so its data shard, is the same in every swarm
    built from the same files, which makes the swarms' losses comparable peer by peer.
    """

    overrides: list[str]
    attacks: dict[int, str]
    identities: list[str]
    procs: list[Any] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)
    peer_ids: list[str] = field(default_factory=list)
    first_maddrs: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.identities)

    def _spawn(self, initial_peers: list[str]) -> None:
        parent, child = CONTEXT.Pipe()
        index = len(self.procs)
        args = (child, self.overrides, initial_peers, self.attacks.get(index), self.identities[index])
        proc = CONTEXT.Process(target=peer_main, args=args)
        proc.start()
        self.procs.append(proc)
        self.conns.append(parent)

    def start_first(self) -> None:
        """Start peer 0; the others join through its addresses."""
        self._spawn([])

    def start_rest(self) -> None:
        """Start peers 1.. at once (each checks its identity file against the swarm for seconds)."""
        first_id, maddrs = self._reply(0, "ready", timeout=120)
        self.peer_ids, self.first_maddrs = [first_id], maddrs
        for _ in range(1, self.size):
            self._spawn(maddrs)

    def wait_ready(self) -> None:
        self.peer_ids += [self._reply(i, "ready", timeout=120)[0] for i in range(1, self.size)]

    def start_joining(self, initial_peers: list[str]) -> None:
        """Start every peer at once through ``initial_peers`` (peers that join a running swarm)."""
        for _ in range(self.size):
            self._spawn(initial_peers)
        self.peer_ids = [self._reply(i, "ready", timeout=120)[0] for i in range(self.size)]

    def go(self, directory: Path) -> list[Path]:
        paths = [directory / f"peer-{i}.json" for i in range(self.size)]
        for conn, path in zip(self.conns, paths, strict=True):
            conn.send(str(path))
        return paths

    def wait_done(self, timeout: float, indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Wait for the "done" of every peer (or of those of ``indices``); return what each reported
        (start and finish times, bans, the state it took over when it joined)."""
        deadline = time.monotonic() + timeout
        return [
            self._reply(index, "done", timeout=max(1.0, deadline - time.monotonic()))[0]
            for index in (range(self.size) if indices is None else indices)
        ]

    def _reply(self, index: int, expected: str, timeout: float) -> tuple[Any, Any]:
        if not self.conns[index].poll(timeout):
            raise TimeoutError(f"peer {index} sent no {expected!r} within {timeout:.0f} s")
        kind, first, second = self.conns[index].recv()
        if kind != expected:
            raise RuntimeError(f"peer {index} failed:\n{first}")
        return first, second

    @property
    def pgids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def close(self, timeout: float = 60.0) -> list[str]:
        """Stop every peer gracefully (SIGTERM to those still running: each closes its node, whose DHT
        process stops its daemon); return what of their process groups outlived that (then killed)."""
        for proc in self.procs:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        return reap_workers(self.procs, self.pgids, time.monotonic() + timeout)


@contextlib.contextmanager
def swarms_stopped_cleanly() -> Iterator[list[Swarm]]:
    """A list for the swarms a test starts; on exit every one is stopped gracefully, and nothing of
    theirs may outlive that, nor any p2p daemon of this process (in-process nodes' included)."""
    from tests.workers.gossip_pool import p2pd_pids, wait_no_leak

    before = p2pd_pids()
    started: list[Swarm] = []
    yield started
    outlived = [described for swarm in started for described in swarm.close()]
    pgids = [pgid for swarm in started for pgid in swarm.pgids]
    assert not outlived, f"processes outlived the swarms' graceful stop (then killed): {outlived}"
    assert not wait_no_leak(before, pgids, parent=os.getpid())
