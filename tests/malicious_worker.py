"""Trainer processes for tests/test_malicious.py: honest peers, and an attacker built from a test hook.

Each peer is a fork of a forkserver that has already imported torch, hivemind and the trainer (a
fresh interpreter per peer costs seconds of CPU on a 2-core machine), in its own process group so
that killing the group also takes its DHT process and p2p daemon down. The attacker is an ordinary
:class:`TrainingPeer` whose pseudo-gradient averager gets ``ExchangeHooks(tamper=...)`` patched in
here: no attack code lives in the product.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "hivemind", "swarm.trainer", "peers.join", "tests.malicious_worker"])

NamedTensors = list[tuple[str, torch.Tensor]]


def scaled(named: NamedTensors) -> NamedTensors:
    """The attacker's own pseudo-gradient, 100 times larger."""
    return [(name, t * 100.0) for name, t in named]


def random_update(named: NamedTensors) -> NamedTensors:
    """Standard normal noise in place of the pseudo-gradient (far larger than honest updates)."""
    return [(name, torch.randn_like(t)) for name, t in named]


ATTACKS = {"scaled": scaled, "random": random_update}


def _install_attack(peer: Any, attack: str) -> None:
    from swarm.gossip._exchange import ExchangeHooks

    averager = peer.backend.deltas
    averager._spec = dataclasses.replace(averager._spec, hooks=ExchangeHooks(tamper=ATTACKS[attack]))


def _log_clips() -> None:
    import swarm.gossip._exchange as exchange

    original = exchange.robust_mix

    def logged(*args: Any) -> Any:
        tensors, stats = original(*args)
        logging.getLogger("clip").warning("w=%.0f v=%.0f %s", args[2], args[4], stats)
        return tensors, stats

    exchange.robust_mix = logged


def peer_main(
    conn: Any, overrides: Sequence[str], initial_peers: Sequence[str], attack: str | None, identity: str
) -> None:
    """Build a trainer, report its id and addresses, train on "go", write its summary, report "done"."""
    os.setpgid(0, 0)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if os.environ.get("MALICIOUS_DEBUG"):
        _log_clips()
    from peers.join import write_summary
    from swarm.config import load_config
    from swarm.network import NetworkOptions
    from swarm.trainer import TrainingPeer

    peer = None
    try:
        config = load_config(None, overrides=list(overrides), env={})
        network = NetworkOptions(initial_peers=list(initial_peers), identity_path=identity)
        peer = TrainingPeer(config, network)
        if attack is not None:
            _install_attack(peer, attack)
        conn.send(("ready", peer.node.peer_id, peer.node.visible_maddrs()))
        summary_path = Path(conn.recv())
        peer.run(threading.Event())
        write_summary(peer, summary_path)
        conn.send(("done", None, None))
    except BaseException:
        conn.send(("error", traceback.format_exc(), None))
    finally:
        if peer is not None:
            peer.close()


@dataclass
class Swarm:
    """Trainers of one run (index 0 is the attacker, if any), started and stopped together.

    Peer ``i`` uses ``identities[i]``: its peer id, and so its data shard, is the same in every swarm
    built from the same files, which makes the swarms' losses comparable peer by peer.
    """

    overrides: list[str]
    attack: str | None
    identities: list[str]
    procs: list[Any] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)
    peer_ids: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.identities)

    def _spawn(self, initial_peers: list[str], attack: str | None) -> None:
        parent, child = CONTEXT.Pipe()
        identity = self.identities[len(self.procs)]
        args = (child, self.overrides, initial_peers, attack, identity)
        proc = CONTEXT.Process(target=peer_main, args=args)
        proc.start()
        self.procs.append(proc)
        self.conns.append(parent)

    def start_first(self) -> None:
        """Start peer 0 (the attacker, if any); the others join through its addresses."""
        self._spawn([], self.attack)

    def start_rest(self) -> None:
        """Start peers 1.. at once (each checks its identity file against the swarm for seconds)."""
        first_id, maddrs = self._reply(0, "ready", timeout=120)
        self.peer_ids = [first_id]
        for _ in range(1, self.size):
            self._spawn(maddrs, None)

    def wait_ready(self) -> None:
        self.peer_ids += [self._reply(i, "ready", timeout=120)[0] for i in range(1, self.size)]

    def go(self, directory: Path) -> list[Path]:
        paths = [directory / f"peer-{i}.json" for i in range(self.size)]
        for conn, path in zip(self.conns, paths, strict=True):
            conn.send(str(path))
        return paths

    def wait_done(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for index in range(self.size):
            self._reply(index, "done", timeout=max(1.0, deadline - time.monotonic()))

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

    def close(self) -> None:
        """Let every peer close (its DHT and daemon) for a moment, then kill what is left of each group."""
        deadline = time.monotonic() + 20
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.join(10)
