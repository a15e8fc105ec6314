"""Reachability dial-back, the asker's side: ask up to a few checkers at once to dial our announced
addresses, and sum up what they answered (the protocol and the checker: ``_reachability.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from swarm.network._reachability import (
    DIAL_TIMEOUT_S,
    IO_TIMEOUT_S,
    MAX_ADDRESSES,
    MESSAGE_MAX_BYTES,
    Kind,
    handler_name,
)
from swarm.p2p import (
    ProtocolError,
    StreamKey,
    check_run_id,
    dial,
    dump_json,
    parse_json,
    read_message,
    run_with_replica,
    swarm_key_of,
    write_message,
)

if TYPE_CHECKING:
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

    from swarm.network._swarm_key import SwarmKey

ReachabilityStatus = Literal["direct", "relay", "unreachable", "unknown", "skipped", "disabled"]


@dataclass(frozen=True)
class ReachabilityResult:
    """What the checkers said. ``status``: ``direct`` (some checker reached some address),
    ``unreachable`` (at least one checker answered and none reached any address), ``unknown`` (no
    checker answered), ``skipped`` (nobody to ask, or nothing to check) or ``disabled`` (the program
    did not ask). ``relay`` is set by the node, not by checkers: nobody reached us directly, and we
    announce ``relay_addresses`` (``/p2p-circuit`` through relays) instead of going into client mode."""

    status: ReachabilityStatus
    addresses: tuple[str, ...] = ()
    reachable: tuple[str, ...] = ()
    answered_by: tuple[str, ...] = ()
    errors: tuple[str, ...] = field(default=())
    relay_addresses: tuple[str, ...] = ()

    @property
    def unreachable(self) -> bool:
        return self.status == "unreachable"


def check_reachability(
    source: DHT | P2P,
    run_id: str,
    checkers: Sequence[str],
    addresses: Sequence[str],
    *,
    max_checkers: int = 3,
    timeout_s: float = IO_TIMEOUT_S + DIAL_TIMEOUT_S + 5,
    swarm_key: SwarmKey | None = None,
) -> ReachabilityResult:
    """Ask up to ``max_checkers`` of ``checkers`` (peer ids) in parallel to dial ``addresses``; blocking.

    ``source`` is a running ``hivemind.DHT`` or ``hivemind.p2p.P2P``; we open our own client to its
    daemon for the checks. A checker that fails or refuses only adds to ``errors``. In a private
    swarm (``swarm_key``, by default the key ``source`` was started with) each check starts with the
    swarm key handshake.
    """
    check_run_id(run_id)
    addresses = list(dict.fromkeys(addresses))[:MAX_ADDRESSES]
    chosen = list(dict.fromkeys(checkers))[:max_checkers]
    if not chosen or not addresses:
        return ReachabilityResult("skipped", tuple(addresses))
    key = swarm_key if swarm_key is not None else swarm_key_of(source)

    async def ask_all(p2p: P2P) -> list[tuple[str, dict[str, Any] | str]]:
        return await _ask_all(p2p, handler_name(run_id), chosen, addresses, key)

    answers = run_with_replica(
        source, ask_all, name=f"reach-ask-{run_id}", open_timeout_s=IO_TIMEOUT_S, timeout_s=timeout_s
    )
    return _summarize(addresses, answers)


async def _ask_all(
    p2p: P2P, handler: str, checkers: list[str], addresses: list[str], key: StreamKey | None
) -> list[tuple[str, dict[str, Any] | str]]:
    replies = await asyncio.gather(
        *(ask(p2p, handler, checker, addresses, swarm_key=key) for checker in checkers),
        return_exceptions=True,
    )
    return [
        (checker, reply if isinstance(reply, dict) else f"{type(reply).__name__}: {reply}")
        for checker, reply in zip(checkers, replies, strict=True)
    ]


async def ask(
    p2p: P2P, handler: str, checker: str, addresses: Sequence[str], swarm_key: StreamKey | None = None
) -> dict[str, Any]:
    """One check: the checker's REPLY as a dict; ProtocolError (with its reason) when it refused or
    answered something other than a list of at most :data:`MAX_ADDRESSES` address strings."""
    reader, writer = await dial(p2p, checker, handler, swarm_key, IO_TIMEOUT_S)
    try:
        await write_message(writer, Kind.REQUEST, dump_json({"addresses": list(addresses)}), IO_TIMEOUT_S)
        kind, payload = await read_message(
            reader, Kind, lambda kind: MESSAGE_MAX_BYTES, IO_TIMEOUT_S + DIAL_TIMEOUT_S
        )
    finally:
        writer.close()
    reply = parse_json(payload)
    if kind is Kind.ERROR:
        raise ProtocolError(f"refused: {str(reply.get('error'))[:200]}")
    if kind is not Kind.REPLY:
        raise ProtocolError(f"unexpected answer {kind.name}")
    reachable = reply.get("reachable")
    if not isinstance(reachable, list) or len(reachable) > MAX_ADDRESSES:
        raise ProtocolError("the answer's 'reachable' is not a list of at most 16 addresses")
    if not all(isinstance(address, str) for address in reachable):
        raise ProtocolError("the answer's 'reachable' holds something other than address strings")
    return reply


def _summarize(addresses: list[str], answers: list[tuple[str, dict[str, Any] | str]]) -> ReachabilityResult:
    asked = set(addresses)
    reachable: dict[str, None] = {}
    answered, errors = [], []
    for checker, reply in answers:
        if isinstance(reply, str):
            errors.append(f"{checker}: {reply}")
            continue
        answered.append(checker)
        reachable.update(dict.fromkeys(a for a in reply["reachable"] if a in asked))
    status: ReachabilityStatus = "unknown" if not answered else "direct" if reachable else "unreachable"
    return ReachabilityResult(status, tuple(addresses), tuple(reachable), tuple(answered), tuple(errors))
