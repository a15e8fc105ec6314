"""Fuzzing the state-transfer RPC (server and client) and the reachability check in process.

Each handler runs against a fake P2P and an ``asyncio.StreamReader`` fed with a scripted, then
mutated, byte stream (dropped, duplicated, swapped, retyped, lengthened, truncated, bit-flipped or
garbage messages). Properties, for every case:

* it ends within CASE_TIMEOUT_S, with a clean rejection: nothing logged at ERROR (the handlers log
  unexpected exception types with ``logger.exception``), and only the documented exception types
  where the caller sees one;
* what the handler writes back is well-formed protocol;
* a client accepts exactly the announced state or nothing;
* afterwards a well-formed request still works (the handler's state is not poisoned).

The shared pieces (fake P2P, the mutation strategy) are in tests/workers/fuzz.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import swarm.state._server as transfer
from swarm.compression import DecodeLimits
from swarm.network._reachability import CheckLimits, ReachabilityChecker
from swarm.network._reachability import Kind as ReachKind
from swarm.network._reachability import handler_name as reach_handler
from swarm.network._reachability_ask import ask as reach_ask
from swarm.p2p import HEADER_LEN, ProtocolError
from swarm.state import StateServer, StateTransferError, make_snapshot
from swarm.state._transfer_protocol import (
    Assembly,
    Kind,
    canonical_meta,
    fetch_part,
    state_digest,
)
from tests.workers.fuzz import (
    CASE_TIMEOUT_S,
    ErrorLog,
    FakeP2P,
    crafted_frames,
    fuzz_settings,
    garbage,
    hostile_variants,
    jmsg,
    msg,
    mutated,
    parse_messages,
    peer_id,
    serve_stream,
)

RUN = "fuzzstate"
FUZZ = fuzz_settings(80)


# ----------------------------------------------------------------------------- state transfer

_s = torch.Generator().manual_seed(5)
STATE = {"a": torch.randn(2500, generator=_s), "b": torch.randn(10, generator=_s)}
SNAPSHOT = make_snapshot(STATE, {"round": 3, "step": 120}, chunk_bytes=4096)
REQUEST = {"digest": SNAPSHOT.digest, "part": 0, "parts": 1}
_hex_digests = st.binary(min_size=32, max_size=32).map(bytes.hex)


@pytest.fixture(scope="module")
def state_server() -> Iterator[tuple[StateServer, FakeP2P]]:
    p2p = FakeP2P("donor")

    server = StateServer(run_id=RUN, p2p_factory=p2p.factory)
    server.publish(SNAPSHOT)
    yield server, p2p
    server.close()


def ask(server: StateServer, p2p: FakeP2P, data: bytes, eof: bool = True) -> list[tuple[int, bytes]]:
    return parse_messages(serve_stream(server, p2p, transfer.handler_name(RUN), data, eof))


def check_answer(reply: list[tuple[int, bytes]]) -> None:
    """Nothing, one ERROR, or a HEADER and exactly the frames it announces, each matching its hash."""
    if not reply:
        return
    kind, payload = reply[0]
    if kind == Kind.ERROR:
        assert len(reply) == 1 and "error" in json.loads(payload)
        return
    assert kind == Kind.HEADER
    header = json.loads(payload)
    assert header["digest"] == SNAPSHOT.digest and len(reply) == 1 + header["sending"]
    sent = {hashlib.sha256(data).hexdigest() for kind, data in reply[1:] if kind == Kind.FRAME}
    assert len(sent) == header["sending"] and sent <= set(header["hashes"])


def assert_serves_a_good_request(server: StateServer, p2p: FakeP2P) -> None:
    reply = ask(server, p2p, jmsg(Kind.REQUEST, REQUEST))
    check_answer(reply)
    assert reply[0][0] == Kind.HEADER and len(reply) == 1 + len(SNAPSHOT.frames)


@FUZZ
@given(
    data=st.one_of(
        mutated([jmsg(Kind.REQUEST, REQUEST)], {0: REQUEST}),
        st.fixed_dictionaries(
            {"digest": st.just(SNAPSHOT.digest) | garbage, "part": garbage, "parts": garbage}
        ).map(lambda body: jmsg(Kind.REQUEST, body)),
        st.tuples(st.integers(-2, 300), st.integers(-2, 300), st.just(SNAPSHOT.digest) | _hex_digests).map(
            lambda pp: jmsg(Kind.REQUEST, {"digest": pp[2], "part": pp[0], "parts": pp[1]})
        ),
    )
)
def test_fuzz_state_server(state_server: tuple[StateServer, FakeP2P], errors: ErrorLog, data: bytes) -> None:
    server, p2p = state_server
    reply = ask(server, p2p, data)
    event(" ".join(Kind(kind).name for kind, _ in reply[:1]) or "nothing")
    check_answer(reply)
    errors.check()
    assert_serves_a_good_request(server, p2p)


def test_state_server_refuses_hostile_json(
    state_server: tuple[StateServer, FakeP2P], errors: ErrorLog
) -> None:
    server, p2p = state_server
    for data in hostile_variants([jmsg(Kind.REQUEST, REQUEST)], {0: REQUEST}):
        assert ask(server, p2p, data) == []
        errors.check()
    assert_serves_a_good_request(server, p2p)


def test_state_server_bounds_memory_and_time(
    state_server: tuple[StateServer, FakeP2P], errors: ErrorLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, p2p = state_server
    tracemalloc.start()
    try:
        for length in (4097, 2**32 - 1):
            assert ask(server, p2p, msg(Kind.REQUEST, b"{" * 1000, length=length)) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes"
    monkeypatch.setattr(transfer, "IO_TIMEOUT_S", 0.3)
    assert ask(server, p2p, b"\x01\x00", eof=False) == []  # a stalled request: the read timeout
    errors.check()
    assert_serves_a_good_request(server, p2p)


# ---------------------------------------------------------------------- state transfer: client

DONOR = peer_id("donor")
FETCH_ERRORS = (ProtocolError, StateTransferError, asyncio.IncompleteReadError, TimeoutError, ConnectionError)


def donor_script(snapshot: Any, part: int = 0, parts: int = 1) -> tuple[list[bytes], dict[str, Any]]:
    indices = range(part, len(snapshot.frames), parts)
    header = {
        "digest": snapshot.digest,
        "frames": len(snapshot.frames),
        "meta": snapshot.meta,
        "chunk_bytes": snapshot.chunk_bytes,
        "hashes": [f.sha256.hex() for f in snapshot.frames],
        "sending": len(indices),
    }
    return [jmsg(Kind.HEADER, header), *(msg(Kind.FRAME, snapshot.frame(i)) for i in indices)], header


GOOD_DONOR, GOOD_HEADER = donor_script(SNAPSHOT)


def fetch(script: bytes, digest: str, limits: DecodeLimits = DecodeLimits()) -> Any:
    """``fetch_part`` (part 0 of 1) against a donor answering ``script``, then ``finish``."""
    p2p = FakeP2P("joiner")
    p2p.script = script

    async def run() -> Any:
        assembly = Assembly(digest, limits)
        await fetch_part(p2p, transfer.handler_name(RUN), DONOR.to_base58(), assembly, 0, 1)
        return await asyncio.to_thread(assembly.finish)

    async def guarded() -> Any:
        return await asyncio.wait_for(run(), CASE_TIMEOUT_S)

    result = asyncio.run(guarded())
    request = parse_messages(bytes(p2p.writers[0].data))
    assert [kind for kind, _ in request] == [Kind.REQUEST]
    return result


@FUZZ
@given(data=mutated(GOOD_DONOR, {0: GOOD_HEADER}))
def test_fuzz_state_client(errors: ErrorLog, data: bytes) -> None:
    """A donor's mutated answer: the documented errors, or exactly the announced state."""
    try:
        snapshot = fetch(data, SNAPSHOT.digest)
    except FETCH_ERRORS as exc:
        event(f"{type(exc).__name__}: {str(exc)[:30]}")
    else:
        assert snapshot.digest == SNAPSHOT.digest
        assert all(torch.equal(snapshot.tensors[name], t) for name, t in STATE.items())
    errors.check()


@FUZZ
@given(
    frames=st.lists(crafted_frames(), min_size=1, max_size=3),
    meta=st.dictionaries(st.text(max_size=4), garbage, max_size=3),
    chunk_bytes=st.sampled_from([4096, 4096, 64 << 20, 1]),
)
def test_fuzz_state_client_hostile_donor(
    errors: ErrorLog, frames: list[bytes], meta: dict, chunk_bytes: int
) -> None:
    """A donor that announced the digest of garbage frames (so every hash checks out): the decoder
    and the re-encoding check must still refuse it, with StateTransferError or ProtocolError."""
    hashes = [hashlib.sha256(f).digest() for f in frames]
    digest = state_digest(canonical_meta(meta), chunk_bytes, hashes)
    header = {
        "digest": digest,
        "frames": len(frames),
        "meta": meta,
        "chunk_bytes": chunk_bytes,
        "hashes": [h.hex() for h in hashes],
        "sending": len(frames),
    }
    script = jmsg(Kind.HEADER, header) + b"".join(msg(Kind.FRAME, f) for f in frames)
    try:
        snapshot = fetch(script, digest, DecodeLimits(max_elements=1 << 16, max_total_elements=1 << 17))
    except FETCH_ERRORS as exc:
        event(f"{type(exc).__name__}: {str(exc)[:40]}")
        return
    finally:
        errors.check()
    assert snapshot.digest == digest
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in snapshot.tensors.values())


def test_state_client_refuses_hostile_json(errors: ErrorLog) -> None:
    for data in hostile_variants(GOOD_DONOR, {0: GOOD_HEADER}):
        with pytest.raises(FETCH_ERRORS):
            fetch(data, SNAPSHOT.digest)
        errors.check()


def test_state_client_bounds_memory() -> None:
    """A header or frame that claims megabytes and then ends: only what arrived is held."""
    header = GOOD_DONOR[0]
    claims = [
        msg(Kind.HEADER, header[HEADER_LEN:], length=(16 << 20)),
        header + msg(Kind.FRAME, b"\0" * 1000, length=SNAPSHOT.chunk_bytes),
        header + msg(Kind.FRAME, b"\0" * 1000, length=2**32 - 1),
    ]
    tracemalloc.start()
    try:
        for script in claims:
            with pytest.raises(FETCH_ERRORS):
                fetch(script, SNAPSHOT.digest)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"peak {peak} bytes"


def test_state_client_accepts_the_honest_donor() -> None:
    """Guard for the fuzz tests above: the unmutated script downloads the state exactly."""
    snapshot = fetch(b"".join(GOOD_DONOR), SNAPSHOT.digest)
    assert snapshot.digest == SNAPSHOT.digest
    assert all(torch.equal(snapshot.tensors[name], t) for name, t in STATE.items())


# ----------------------------------------------------------------------- reachability dial-back

LOOPBACK = ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/9", "/ip6/::1/tcp/1"]
"""What every asker "announces": only loopback ports that refuse at once, so no case dials out."""
REACH_REQUEST = {"addresses": LOOPBACK[:2]}
REACH_REPLY = {"reachable": [], "unreachable": LOOPBACK[:2]}
REACH_ERRORS = (ProtocolError, asyncio.IncompleteReadError, TimeoutError, ConnectionError)


@pytest.fixture(scope="module")
def checker() -> Iterator[tuple[ReachabilityChecker, FakeP2P]]:
    p2p = FakeP2P("checker")

    with ReachabilityChecker(
        lambda peer: LOOPBACK, run_id=RUN, p2p_factory=p2p.factory, dial_timeout_s=0.5
    ) as c:
        # Fuzzing is about what a request says; the budgets (tests/test_hostile_reach.py) would refuse
        # every case past the 8th from the one source address a fake stream has.
        c.limits = CheckLimits(cooldown_s=0.0, per_source=10**9, total=10**9)
        yield c, p2p


def check(checker: ReachabilityChecker, p2p: FakeP2P, data: bytes) -> list[tuple[int, bytes]]:
    return parse_messages(serve_stream(checker, p2p, reach_handler(RUN), data))


@FUZZ
@given(
    data=st.one_of(
        mutated([jmsg(ReachKind.REQUEST, REACH_REQUEST)], {0: REACH_REQUEST}),
        st.lists(st.sampled_from(LOOPBACK) | st.text(max_size=30) | garbage, max_size=20).map(
            lambda addresses: jmsg(ReachKind.REQUEST, {"addresses": addresses})
        ),
    )
)
def test_fuzz_reachability_checker(
    checker: tuple[ReachabilityChecker, FakeP2P], errors: ErrorLog, data: bytes
) -> None:
    """Nothing, one ERROR, or one REPLY that only covers announced addresses; it dials nothing else."""
    server, p2p = checker
    reply = check(server, p2p, data)
    errors.check()
    event(" ".join(ReachKind(kind).name for kind, _ in reply) or "nothing")
    assert len(reply) <= 1
    if reply and reply[0][0] == ReachKind.REPLY:
        answer = json.loads(reply[0][1])
        assert set(answer["reachable"]) | set(answer["unreachable"]) <= set(LOOPBACK)
    elif reply:
        assert reply[0][0] == ReachKind.ERROR and "error" in json.loads(reply[0][1])
    good = check(server, p2p, jmsg(ReachKind.REQUEST, REACH_REQUEST))
    assert [kind for kind, _ in good] == [ReachKind.REPLY]


@FUZZ
@given(data=mutated([jmsg(ReachKind.REPLY, REACH_REPLY)], {0: REACH_REPLY}))
def test_fuzz_reachability_answer(errors: ErrorLog, data: bytes) -> None:
    """The asking side: a checker's mutated answer is a dict with a "reachable" list, or an error."""
    p2p = FakeP2P("asker")
    p2p.script = data

    async def run() -> dict[str, Any]:
        return await asyncio.wait_for(
            reach_ask(p2p, reach_handler(RUN), peer_id("checker").to_base58(), LOOPBACK[:2]), CASE_TIMEOUT_S
        )

    try:
        answer = asyncio.run(run())
    except REACH_ERRORS as exc:
        event(type(exc).__name__)
        return
    assert isinstance(answer, dict) and isinstance(answer["reachable"], list)
    errors.check()


def test_reachability_refuses_hostile_json(
    checker: tuple[ReachabilityChecker, FakeP2P], errors: ErrorLog
) -> None:
    server, p2p = checker
    for data in hostile_variants([jmsg(ReachKind.REQUEST, REACH_REQUEST)], {0: REACH_REQUEST}):
        assert [kind for kind, _ in check(server, p2p, data)] in ([ReachKind.ERROR], [])  # [] if oversized
        errors.check()
    for data in hostile_variants([jmsg(ReachKind.REPLY, REACH_REPLY)], {0: REACH_REPLY}):
        asker = FakeP2P("asker")
        asker.script = data
        try:
            answer = asyncio.run(
                reach_ask(asker, reach_handler(RUN), peer_id("checker").to_base58(), LOOPBACK)
            )
        except REACH_ERRORS:
            continue
        assert isinstance(answer["reachable"], list)  # only "unreachable" was hostile: ask() ignores it


@pytest.mark.parametrize("entry", [{}, []])
def test_reachability_answer_with_unhashable_entries(entry: object) -> None:
    p2p = FakeP2P("asker")
    p2p.script = jmsg(ReachKind.REPLY, {"reachable": [entry], "unreachable": []})

    async def run() -> dict[str, Any]:
        return await reach_ask(p2p, reach_handler(RUN), peer_id("checker").to_base58(), LOOPBACK[:1])

    with pytest.raises(ProtocolError, match="reachable"):
        asyncio.run(run())
