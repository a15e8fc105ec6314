"""Starting a hivemind DHT (and its p2p daemon) from validated network options."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import psutil
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID

from swarm._errors import SwarmError
from swarm.network._addresses import expand_listen_options, parse_maddrs
from swarm.network._dht_auth import SharedKeyAuthorizer
from swarm.network._identity import ensure_identity, ephemeral_identity
from swarm.network._startup import shm_manager_first
from swarm.network._swarm_key import SwarmKey, load_swarm_key

logger = logging.getLogger(__name__)


class NetworkError(SwarmError, RuntimeError):
    """The DHT or its p2p daemon could not start, or could not reach the initial peers."""


@dataclass(frozen=True)
class NetworkOptions:
    """Everything needed to put one peer on the network.

    Build it with :meth:`from_user_input` so that shortcuts are expanded and every address is validated.
    ``swarm_key`` makes the swarm private: every DHT RPC and every swarm stream is then authenticated.

    ``behind_nat``: the peer may not be dialable (a home router without a port forward). If the
    dial-back check confirms it, the peer announces itself through its initial peers, which forward
    streams to it (:mod:`swarm.p2p._forward`), instead of going into client mode. ``relay``: this
    peer relays for such peers (a bootstrap always does; the program starts the relay).
    """

    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None
    client_mode: bool = False
    startup_timeout_s: float = 30.0
    swarm_key: SwarmKey | None = None
    behind_nat: bool = False
    relay: bool = False

    @classmethod
    def from_user_input(
        cls,
        *,
        initial_peers: Sequence[str],
        host_maddrs: Sequence[str],
        announce_maddrs: Sequence[str],
        identity_path: str | None = None,
        client_mode: bool = False,
        startup_timeout_s: float = 30.0,
        port: int | None = None,
        public_ip: str | None = None,
        host_maddrs_given: bool = False,
        announce_maddrs_given: bool = False,
        swarm_key_file: str | None = None,
        environ: Mapping[str, str] | None = None,
        behind_nat: bool = False,
        relay: bool = False,
    ) -> NetworkOptions:
        """Validate every address (raising :class:`~swarm.network.AddressError`) and expand shortcuts.

        The swarm key comes from ``swarm_key_file`` or the ``SWARM_KEY`` variable of ``environ``
        (default: the process environment); a bad one raises :class:`~swarm.network.SwarmKeyError`.
        """
        parse_maddrs(initial_peers, what="initial peer", require_peer_id=True)
        listen = expand_listen_options(
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs,
            port=port,
            public_ip=public_ip,
            host_maddrs_given=host_maddrs_given,
            announce_maddrs_given=announce_maddrs_given,
        )
        return cls(
            initial_peers=list(initial_peers),
            host_maddrs=listen.host_maddrs,
            announce_maddrs=listen.announce_maddrs,
            identity_path=identity_path,
            client_mode=client_mode,
            startup_timeout_s=startup_timeout_s,
            swarm_key=load_swarm_key(swarm_key_file, os.environ if environ is None else environ),
            behind_nat=behind_nat,
            relay=relay,
        )

    def relay_addresses(self, peer_id: str) -> list[str]:
        """``/p2p-circuit`` addresses of ``peer_id`` through each initial peer (its trusted relays)."""
        relays = [maddr for maddr in self.initial_peers if "/p2p-circuit" not in maddr]
        return [f"{maddr}/p2p-circuit/p2p/{peer_id}" for maddr in relays]

    def resolved_identity_path(self) -> Path:
        """The configured identity file, created (mode 0600) if missing.

        Without a configured path a throwaway identity is made in a private temporary directory;
        the caller removes it once the daemon has read it.
        """
        if self.identity_path is None:
            return ephemeral_identity()
        return ensure_identity(self.identity_path)


class _OwnedDHT(hivemind.DHT):
    """A hivemind DHT whose worker process never outlives its owner.

    hivemind runs the DHT in a forked worker that starts ``p2pd``. If the owner dies without shutting
    it down (SIGKILL, OOM killer), both would live on as orphans. Here the worker watches its parent
    and, when the parent is gone or it receives SIGTERM, stops its daemon and exits.

    ``swarm_key`` is the key of a private swarm (None: public): everything opened on this DHT's daemon
    (gossip averagers, state servers and downloads) takes it from here, so none can forget it.
    """

    swarm_key: SwarmKey | None = None

    def run(self) -> None:
        owner_pid = os.getppid()
        _leave_terminal_group()
        signal.signal(signal.SIGTERM, lambda signum, frame: _stop_worker(0))
        threading.Thread(target=_watch_owner, args=(owner_pid,), name="dht-owner-watch", daemon=True).start()
        super().run()


def _leave_terminal_group() -> None:
    """Take this worker (and the ``p2pd`` it is about to start) out of its owner's process group.

    A terminal's Ctrl+C signals the whole foreground process group. The daemon, reached directly, died
    at once (go-libp2p logged ``[ERROR] ... use of closed network connection``); the worker's event loop
    then waited on it, and hivemind's ``DHT.shutdown`` gave up after its 3 s grace period
    (``[WARN] DHT did not shut down within the grace period``). Out of the group, only the owner gets
    the signal, and it shuts the worker and its daemon down in order. A dead owner is still noticed
    (:func:`_watch_owner`); the session stays the owner's, so session-wide cleanups still find both.
    """
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # any SIGINT that still lands here: the owner decides


def _watch_owner(owner_pid: int, period_s: float = 1.0) -> None:
    while os.getppid() == owner_pid:
        time.sleep(period_s)  # a parent's death has no event to wait on; poll
    _stop_worker(1)


def _stop_worker(status: int) -> None:
    """Terminate this worker's children (the p2p daemon), then exit immediately."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    psutil.wait_procs(children, timeout=3)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(status)


def _start_shared_memory_manager() -> None:
    """Have torch start its ``torch_shm_manager`` now, with SIGINT and SIGTERM blocked.

    hivemind shares its futures' state through torch's ``file_system`` memory sharing, whose first use
    starts that helper process (creating the DHT does). It is started in our process group, and for a
    moment, before it detaches, a terminal's Ctrl+C killed it too: torch then waited for it forever
    (or failed with "error executing torch_shm_manager"). Started from here it inherits the blocked
    mask, so the signal waits in it until it has detached; ours is handled once the mask is restored.
    """
    import torch

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        torch.empty(1, dtype=torch.uint8).share_memory_()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_dht(
    options: NetworkOptions,
    identity_path: str | os.PathLike,
    record_validators: Sequence[RecordValidatorBase] = (),
) -> hivemind.DHT:
    """Start a DHT node in a background process; raise :class:`NetworkError` with the cause if it fails."""
    kwargs = dict(
        host_maddrs=options.host_maddrs,
        identity_path=str(identity_path),
        client_mode=options.client_mode,
        startup_timeout=options.startup_timeout_s,
        # A fresh throwaway identity cannot be taken; skipping the check saves a network round trip.
        check_if_identity_free=options.identity_path is not None,
    )
    if options.announce_maddrs:
        kwargs["announce_maddrs"] = options.announce_maddrs
    if options.swarm_key is not None:
        logger.info("private swarm: DHT RPCs authenticated with swarm key %s", options.swarm_key.fingerprint)
    logger.debug("starting DHT with initial peers %s and %s", options.initial_peers, kwargs)
    if shm_manager_first():
        _start_shared_memory_manager()
    dht = _OwnedDHT(
        initial_peers=options.initial_peers or None,
        start=False,
        record_validators=list(record_validators),
        authorizer=None if options.swarm_key is None else SharedKeyAuthorizer(options.swarm_key),
        **kwargs,
    )
    dht.swarm_key = options.swarm_key
    try:
        dht.run_in_background(await_ready=True, timeout=options.startup_timeout_s + 5)
    except BaseException as exc:
        dht.shutdown()
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise NetworkError(_explain_start_failure(options, exc)) from exc
    return dht


def _explain_start_failure(options: NetworkOptions, exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if options.initial_peers:
        peers = ", ".join(options.initial_peers)
        live = [address for address in options.initial_peers if _something_listens(address)]
        if live:  # the address answers, so the peer there is not the one named
            return (
                f"could not join the swarm through {peers}: {text}; something listens at "
                f"{', '.join(live)} but it is not that peer: check the /p2p/<peer id> part (copy the "
                "whole address the bootstrap printed)"
            )
        return f"could not join the swarm through {peers}: {text} (is that peer running and reachable?)"
    return f"could not start the p2p network on {', '.join(options.host_maddrs)}: {text}"


def _something_listens(address: str, timeout_s: float = 2.0) -> bool:
    """Whether a plain TCP connection to ``address``'s ``/ip4|ip6|dns/.../tcp/PORT`` part succeeds."""
    from multiaddr import Multiaddr

    try:
        parts = dict(Multiaddr(address).items())
        host = next(str(parts[k]) for k in parts if k.name in ("ip4", "ip6", "dns", "dns4", "dns6"))
        port = int(next(str(v) for k, v in parts.items() if k.name == "tcp"))
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except (OSError, ValueError, StopIteration):
        return False


def rejoin_initial_peers(
    dht: hivemind.DHT, initial_peers: Sequence[str], *, return_future: bool = False
) -> Any:
    """Ping the initial peers that this node's routing table has lost; return how many answered (or,
    with ``return_future``, a future of that number, at once).

    hivemind drops a node from the routing table at the first request it leaves unanswered, and
    learns nodes only from requests. So when a partition heals, each side has forgotten the other for
    good: nobody asks across the former cut again, and the swarm stays split (each half reads only its
    own members). A ping answered puts the initial peer (the swarm's entry point) back in our table and
    us in its table; lookups through it then reach the rest of the swarm again. The daemon was given the
    initial peers' addresses at start, so it can dial them again once they are reachable. A ping to a
    peer still out of reach ends after the DHT's request timeout.
    """
    maddrs = parse_maddrs(initial_peers, what="initial peer", require_peer_id=True)
    peer_ids = {maddr.value_for_protocol("p2p") for maddr in maddrs} - {dht.peer_id.to_base58()}
    ping = functools.partial(_ping_missing, sorted(peer_ids))
    return dht.run_coroutine(ping, return_future=return_future)


async def _ping_missing(peer_ids: list[str], _dht: hivemind.DHT, node: DHTNode) -> int:
    protocol = node.protocol
    missing = [PeerID.from_base58(p) for p in peer_ids]
    missing = [p for p in missing if protocol.routing_table.get(peer_id=p) is None]
    answers = await asyncio.gather(*(protocol.call_ping(p) for p in missing))
    return sum(answer is not None for answer in answers)


CONNECT_TIMEOUT_S = 10.0


def connect_out(dht: hivemind.DHT, peers: Mapping[str, Sequence[str]], *, return_future: bool = False) -> Any:
    """Have this node's daemon connect to each of ``peers`` (peer id -> its announced addresses) that it
    is not connected to; return how many of them it is connected to afterwards (or a future of it).

    A peer behind NAT that nobody can dial connects out to the directly reachable members this way.
    Their streams to it then run over these connections (:func:`swarm.p2p.dial` opens a stream directly
    when a connection exists), and only peers that are behind NAT themselves need a relay.
    """
    me = dht.peer_id.to_base58()
    targets = {
        peer: [a.rsplit("/p2p/", 1)[0] for a in addresses if "/p2p-circuit" not in a]
        for peer, addresses in peers.items()
        if peer != me
    }
    targets = {peer: addresses for peer, addresses in targets.items() if addresses}
    return dht.run_coroutine(functools.partial(_connect_missing, targets), return_future=return_future)


async def _connect_missing(targets: dict[str, list[str]], _dht: hivemind.DHT, node: DHTNode) -> int:
    from multiaddr import Multiaddr

    p2p = node.p2p
    connected = {info.peer_id.to_base58() for info in await p2p.list_peers()}

    async def connect(peer: str, addresses: list[str]) -> bool:
        try:
            maddrs = [Multiaddr(a) for a in addresses]
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), maddrs), CONNECT_TIMEOUT_S)
        except Exception:  # unreachable for now: the next round of announcements tries again
            return False
        return True

    missing = [peer for peer in targets if peer not in connected]
    made = await asyncio.gather(*(connect(peer, targets[peer]) for peer in missing))
    return len(connected & targets.keys()) + sum(made)
