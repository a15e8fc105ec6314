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

import swarm.state._server as server_module
import swarm.state._transfer_protocol as transfer
from swarm.compression import DecodeLimits
from swarm.network._reachability import CheckLimits, ReachabilityChecker
from swarm.network._reachability import Kind as ReachKind
from swarm.network._reachability import handler_name as reach_handler
from swarm.network._reachability_ask import ask as reach_ask
from swarm.p2p import HEADER_LEN, ProtocolError
from swarm.state import StateServer, StateTransferError, make_snapshot, spool_state
from swarm.state._snapshot import canonical_meta, state_digest
from swarm.state._transfer_protocol import MAX_FRAMES, Assembly, Header, Kind, fetch_part
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
STATE = {name: torch.randn(n, generator=_s).bfloat16().float() for name, n in (("a", 2500), ("b", 10))}
"""Values bf16 holds: what a donor serves is exactly these."""
META = {"round": 3, "step": 120}
SNAPSHOT = spool_state(STATE, META, chunk_bytes=4096)
"""The served form (frames in a spool file, open for the module's lifetime)."""
REQUEST = {"digest": SNAPSHOT.digest, "part": 0, "parts": 1, "skip": 0}
_hex_digests = st.binary(min_size=32, max_size=32).map(bytes.hex)


@pytest.fixture(scope="module")
def state_server() -> Iterator[tuple[StateServer, FakeP2P]]:
    p2p = FakeP2P("donor")

    server = StateServer(run_id=RUN, p2p_factory=p2p.factory)
    server.publish(make_snapshot(STATE, META, chunk_bytes=4096))  # spooled by the server, closed with it
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
    assert reply[0][0] == Kind.HEADER and len(reply) == 1 + SNAPSHOT.frame_count


@FUZZ
@given(
    data=st.one_of(
        mutated([jmsg(Kind.REQUEST, REQUEST)], {0: REQUEST}),
        st.fixed_dictionaries(
            {
                "digest": st.just(SNAPSHOT.digest) | garbage,
                "part": garbage,
                "parts": garbage,
                "skip": st.just(0) | garbage,
            }
        ).map(lambda body: jmsg(Kind.REQUEST, body)),
        st.tuples(
            st.integers(-2, 300),
            st.integers(-2, 300),
            st.just(SNAPSHOT.digest) | _hex_digests,
            st.integers(-2, 12) | st.sampled_from([2**31, 2**63, 10**30]),
        ).map(lambda r: jmsg(Kind.REQUEST, {"digest": r[2], "part": r[0], "parts": r[1], "skip": r[3]})),
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


def frames_of(reply: list[tuple[int, bytes]]) -> list[str]:
    """The sha256 of each frame a donor sent, in order."""
    return [hashlib.sha256(data).hexdigest() for kind, data in reply if kind == Kind.FRAME]


def test_state_server_sends_only_the_tail_a_request_skips(
    state_server: tuple[StateServer, FakeP2P], errors: ErrorLog
) -> None:
    server, p2p = state_server
    hashes = [h.hex() for h in SNAPSHOT.hashes]
    for part, parts in ((0, 1), (1, 2), (0, 3), (2, 3)):
        size = len(range(part, len(hashes), parts))
        for skip in (0, 1, size // 2, size):
            request = {**REQUEST, "part": part, "parts": parts, "skip": skip}
            reply = ask(server, p2p, jmsg(Kind.REQUEST, request))
            assert json.loads(reply[0][1])["sending"] == size - skip, (part, parts, skip)
            assert frames_of(reply) == hashes[part::parts][skip:], (part, parts, skip)
    size = len(range(0, len(hashes), 2))
    refused = [size + 1, -1, MAX_FRAMES + 1, 2**63, True, None, "1", 1.5, [1]]
    for skip in refused:  # past the part's end, out of range, or not an integer: nothing is sent
        assert ask(server, p2p, jmsg(Kind.REQUEST, {**REQUEST, "parts": 2, "skip": skip})) == [], skip
    without = {k: v for k, v in REQUEST.items() if k != "skip"}
    assert ask(server, p2p, jmsg(Kind.REQUEST, without)) == []
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
    monkeypatch.setattr(server_module, "IO_TIMEOUT_S", 0.3)
    assert ask(server, p2p, b"\x01\x00", eof=False) == []  # a stalled request: the read timeout
    errors.check()
    assert_serves_a_good_request(server, p2p)


# ---------------------------------------------------------------------- state transfer: client

DONOR = peer_id("donor")
FETCH_ERRORS = (ProtocolError, StateTransferError, asyncio.IncompleteReadError, TimeoutError, ConnectionError)


def donor_script(snapshot: Any, part: int = 0, parts: int = 1) -> tuple[list[bytes], dict[str, Any]]:
    indices = range(part, snapshot.frame_count, parts)
    header = {
        "digest": snapshot.digest,
        "frames": snapshot.frame_count,
        "meta": snapshot.meta,
        "chunk_bytes": snapshot.chunk_bytes,
        "hashes": [h.hex() for h in snapshot.hashes],
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
    chunk_bytes=st.sampled_from([4096, 4096, transfer.MAX_RECV_CHUNK_BYTES, 64 << 20, 1]),
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


def test_a_resumed_part_asks_only_for_the_frames_that_did_not_arrive(errors: ErrorLog) -> None:
    """A part that an earlier donor half delivered: the request skips what arrived, the assembly takes
    exactly the rest; a donor that ignores the skip (announcing the whole part) is refused."""
    arrived = SNAPSHOT.frame_count // 2
    header = Header.parse(json.dumps(GOOD_HEADER).encode(), SNAPSHOT.digest)

    def half_done() -> Assembly:
        assembly = Assembly(SNAPSHOT.digest, DecodeLimits())
        assembly.accept(header)
        for index in range(arrived):
            assembly.add(index, SNAPSHOT.frame(index), "first donor")
        return assembly

    def resume(script: bytes, assembly: Assembly) -> list[tuple[int, bytes]]:
        p2p = FakeP2P("joiner")
        p2p.script = script
        asyncio.run(fetch_part(p2p, transfer.handler_name(RUN), DONOR.to_base58(), assembly, 0, 1))
        return parse_messages(bytes(p2p.writers[0].data))

    tail = {**GOOD_HEADER, "sending": SNAPSHOT.frame_count - arrived}
    script = jmsg(Kind.HEADER, tail) + b"".join(GOOD_DONOR[1 + arrived :])
    assembly = half_done()
    [(kind, request)] = resume(script, assembly)
    assert kind == Kind.REQUEST and json.loads(request)["skip"] == arrived
    snapshot = assembly.finish()
    assert snapshot.digest == SNAPSHOT.digest
    assert all(torch.equal(snapshot.tensors[n], t) for n, t in STATE.items())
    assert assembly.received_bytes == SNAPSHOT.nbytes  # every frame once
    with pytest.raises(ProtocolError, match="header announces"):
        resume(b"".join(GOOD_DONOR), half_done())
    errors.check()


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
