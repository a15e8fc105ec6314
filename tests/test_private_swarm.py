"""Private swarms: the swarm key (loading, never shown), the DHT authorizer, the stream handshake, and
three proofs with real peers that a peer without the key cannot write DHT records, exchange tensors
or download state, while peers with the key do all three."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import get_dht_time
from typer.testing import CliRunner

from peers import _common as common
from peers.cli import app
from scripts._held import gossip_averager
from swarm import NodeInfo, SwarmNode
from swarm._protocol import PROTOCOL_VERSION
from swarm.config import RunConfig
from swarm.gossip import GossipAverager, PartnerInfo, SyncOutcome
from swarm.membership import PeerRecord, membership_validators, record_key
from swarm.network import (
    NetworkError,
    NetworkOptions,
    SwarmKey,
    SwarmKeyError,
    ensure_identity,
    load_identity,
    load_swarm_key,
)
from swarm.network._dht_auth import MAX_SKEW_S, SharedKeyAuthorizer
from swarm.network._reachability_ask import check_reachability
from swarm.p2p import AuthError, authenticate_stream
from swarm.state import StateServer, StateTransferError, download_state, make_snapshot
from tests._processes import wait_until

RUN = "private-test"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
REPO = Path(__file__).resolve().parent.parent


def _secret() -> str:
    return secrets.token_hex(32)


def _key() -> SwarmKey:
    return SwarmKey(_secret().encode())


def _key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# ---------------------------------------------------------------------------- loading the key


def test_key_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    secret = _secret()
    good = _key_file(tmp_path / "good.key", secret + "\n")
    assert load_swarm_key(good, {}) == SwarmKey(secret.encode())
    assert load_swarm_key(None, {}) is None
    for mode in (0o640, 0o604, 0o660):
        loose = _key_file(tmp_path / f"loose{mode:o}.key", secret, mode)
        with pytest.raises(SwarmKeyError, match=rf"by group or others \(mode 0{mode:o}\).*chmod 600"):
            load_swarm_key(loose, {})
    short = _key_file(tmp_path / "short.key", secret[:15])
    with pytest.raises(SwarmKeyError, match="15 bytes long; it must be at least 16"):
        load_swarm_key(short, {})
    with pytest.raises(SwarmKeyError, match="distinct characters"):
        load_swarm_key(_key_file(tmp_path / "dull.key", "ab" * 20), {})
    with pytest.raises(SwarmKeyError, match="cannot be read"):
        load_swarm_key(tmp_path / "missing.key", {})


def test_key_from_the_environment(tmp_path: Path) -> None:
    secret = _secret()
    assert load_swarm_key(None, {"SWARM_KEY": secret}) == SwarmKey(secret.encode())
    with pytest.raises(SwarmKeyError, match=r"SWARM_KEY: .*at least 16"):
        load_swarm_key(None, {"SWARM_KEY": "tooshort"})
    with pytest.raises(SwarmKeyError, match="set only one"):
        load_swarm_key(_key_file(tmp_path / "k", secret), {"SWARM_KEY": secret})
    options = NetworkOptions.from_user_input(
        initial_peers=[], host_maddrs=[LOOPBACK], announce_maddrs=[], environ={"SWARM_KEY": secret}
    )
    assert options.swarm_key == SwarmKey(secret.encode())


def test_the_key_is_never_shown(tmp_path: Path) -> None:
    secret = _secret()
    key = SwarmKey(secret.encode())
    options = NetworkOptions(swarm_key=key)
    shown = [repr(key), str(key), f"{key}", repr(options), repr(SharedKeyAuthorizer(key))]
    for text in shown:
        assert secret not in text and secret[:16] not in text
    assert key.fingerprint in repr(key)
    assert SwarmKey(secret.encode()).fingerprint == key.fingerprint != _key().fingerprint
    with pytest.raises(SwarmKeyError) as short:
        SwarmKey(secret[:12].encode())
    assert secret[:12] not in str(short.value)

    key_file = _key_file(tmp_path / "swarm.key", secret)
    args = ["config", "show", str(REPO / "configs/local-tiny.yaml")]
    args += ["--set", f"network.swarm_key_file={key_file}"]
    result = CliRunner().invoke(app, args, env={"SWARM_KEY": _secret()})
    assert result.exit_code == 0, result.output
    assert str(key_file) in result.output and secret not in result.output


def test_key_file_is_per_peer_and_bad_keys_exit_2(tmp_path: Path) -> None:
    plain = RunConfig()
    keyed = RunConfig.model_validate({"network": {"swarm_key_file": str(tmp_path / "k")}})
    assert keyed.config_hash() == plain.config_hash()
    _key_file(tmp_path / "k", _secret(), 0o644)
    with pytest.raises(Exception) as exited:
        common.resolve_network(keyed, common.NetworkFlags())
    assert getattr(exited.value, "exit_code", None) == 2


def test_keygen_makes_a_private_loadable_key(tmp_path: Path) -> None:
    path = tmp_path / "new.key"
    runner = CliRunner()
    made = runner.invoke(app, ["config", "keygen", "-o", str(path)])
    assert made.exit_code == 0, made.output
    assert os.stat(path).st_mode & 0o777 == 0o600
    key = load_swarm_key(path, {})
    assert key is not None and key.fingerprint in made.output
    assert path.read_text().strip() not in made.output
    again = runner.invoke(app, ["config", "keygen", "-o", str(path)])
    assert again.exit_code == 2 and "refusing to overwrite" in again.output
    assert load_swarm_key(path, {}) == key


# ---------------------------------------------------------------------------- the DHT authorizer


def _run(coro):
    return asyncio.run(coro)


def _signed_request(authorizer: SharedKeyAuthorizer) -> dht_pb2.StoreRequest:
    request = dht_pb2.StoreRequest(keys=[b"k" * 20], subkeys=[b"s"], values=[b"v"], expiration_time=[1.0])
    _run(authorizer.sign_request(request, None))
    return request


def _copy(message):
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def test_authorizer_accepts_the_key_and_refuses_everything_else() -> None:
    key = _key()
    client, server = SharedKeyAuthorizer(key), SharedKeyAuthorizer(key)
    request = _signed_request(client)
    assert _run(server.validate_request(_copy(request)))

    assert server.check_request(_copy(request)) == "replayed (nonce already used)"
    tampered = _copy(_signed_request(client))
    tampered.values[0] = b"forged"
    assert "signature" in server.check_request(tampered)
    assert "signature" in server.check_request(_signed_request(SharedKeyAuthorizer(_key())))
    unsigned = dht_pb2.StoreRequest(keys=[b"k" * 20], subkeys=[b"s"], values=[b"v"], expiration_time=[1.0])
    assert "signature" in server.check_request(unsigned)

    behind = SharedKeyAuthorizer(key, clock=lambda: time.time() - 2 * MAX_SKEW_S)
    assert "timestamp" in server.check_request(_signed_request(behind))

    fresh = _signed_request(client)
    response = dht_pb2.StoreResponse(store_ok=[True])
    _run(server.sign_response(response, fresh))
    assert _run(client.validate_response(_copy(response), fresh))
    forged = _copy(response)
    forged.store_ok[0] = False
    assert not _run(client.validate_response(forged, fresh))
    assert not _run(client.validate_response(_copy(response), _signed_request(client)))  # another request
    wrong = dht_pb2.StoreResponse(store_ok=[True])
    _run(SharedKeyAuthorizer(_key()).sign_response(wrong, fresh))
    assert not _run(client.validate_response(wrong, fresh))


# ---------------------------------------------------------------------------- the stream handshake


async def _handshake(
    key_i: SwarmKey | None,
    key_r: SwarmKey | None,
    *,
    ids_i: tuple[str, str] = ("alice", "bob"),
    ids_r: tuple[str, str] = ("bob", "alice"),
) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides over a loopback TCP connection; return what each raised (None: success)."""
    outcome: dict[str, BaseException | None] = {}
    done = asyncio.Event()

    async def side(reader, writer, key, initiator, ids) -> BaseException | None:
        try:
            if key is None:  # a peer without a key starts its protocol at once
                writer.write(bytes([1]) + (2).to_bytes(4, "big") + b"{}")
                await writer.drain()
                await reader.read()
                return AuthError("no key")
            await authenticate_stream(
                reader,
                writer,
                key=key,
                initiator=initiator,
                protocol="swarm.test.v1",
                local_peer=ids[0],
                remote_peer=ids[1],
                timeout=5,
            )
            return None
        except AuthError as exc:
            return exc
        finally:
            writer.close()

    async def serve(reader, writer) -> None:
        outcome["r"] = await side(reader, writer, key_r, False, ids_r)
        done.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    outcome["i"] = await side(reader, writer, key_i, True, ids_i)
    await asyncio.wait_for(done.wait(), 10)
    server.close()
    await server.wait_closed()
    return outcome["i"], outcome["r"]


def test_handshake_needs_the_same_key_and_the_right_peers() -> None:
    key = _key()
    assert _run(_handshake(key, key)) == (None, None)
    for initiator_error, responder_error in (
        _run(_handshake(key, _key())),  # another key
        _run(_handshake(key, key, ids_i=("mallory", "bob"))),  # a proof made for another pair of peers
    ):
        assert isinstance(initiator_error, AuthError) and "wrong swarm key proof" in str(initiator_error)
        assert isinstance(responder_error, AuthError)
    _, refused = _run(_handshake(None, key))  # no key: its first message is refused, nothing else read
    assert isinstance(refused, AuthError) and "unknown message kind 1" in str(refused)
    failed, _ = _run(_handshake(key, None))
    assert isinstance(failed, AuthError) and "does it hold the swarm key" in str(failed)


# ---------------------------------------------------------------------------- real peers


def _node(key: SwarmKey | None, initial_peers: list[str] | None = None) -> SwarmNode:
    options = NetworkOptions(initial_peers=initial_peers or [], swarm_key=key)
    return SwarmNode(options, NodeInfo(RUN, "ab12", "trainer"), record_ttl_s=30)


@contextlib.contextmanager
def _keyed_pair_and_outsider() -> Iterator[tuple[SwarmNode, SwarmNode, hivemind.DHT]]:
    """Two nodes holding one swarm key (``b`` bootstrapped from ``a``) and a keyless DHT that dials ``a``
    directly (its bootstrap is refused); all three are shut down afterwards."""
    key = _key()
    a = _node(key)
    b = _node(key, a.visible_maddrs())
    outsider = hivemind.DHT(
        initial_peers=a.visible_maddrs(), host_maddrs=[LOOPBACK], ensure_bootstrap_success=False, start=True
    )
    try:
        yield a, b, outsider
    finally:
        outsider.shutdown()
        b.close()
        a.close()


def _outsider(
    initial_peers: list[str], authorizer: SharedKeyAuthorizer | None, identity: Path
) -> tuple[hivemind.DHT, bytes]:
    """A DHT that dials the swarm directly (its bootstrap is refused) and signs records like a member;
    returns it and its record subkey (its public key marker)."""
    signer = RSASignatureValidator(load_identity(ensure_identity(identity)))
    dht = hivemind.DHT(
        initial_peers=initial_peers,
        host_maddrs=[LOOPBACK],
        identity_path=str(identity),
        record_validators=membership_validators(RUN, signer),
        authorizer=authorizer,
        ensure_bootstrap_success=False,
        start=True,
    )
    return dht, signer.local_public_key


async def _push_record(dht: hivemind.DHT, node: object, target: str, subkey: bytes) -> tuple[bool, object]:
    """In the outsider's DHT process: ping ``target``, then ask it to store our signed record."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.p2p import PeerID

    protocol = node.protocol
    peer = PeerID.from_base58(target)
    pinged = await protocol.call_ping(peer)
    peer_id = dht.peer_id.to_base58()
    record = PeerRecord(
        peer_id=peer_id, protocol_version=1, package_version="x", config_hash="ab", role="trainer"
    )
    expiration = get_dht_time() + 30
    key_id = DHTID.generate(source=record_key(RUN))
    value = protocol.serializer.dumps(record.dict())
    signed = protocol.record_validator.sign_value(
        DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value, expiration)
    )
    stored = await protocol.call_store(peer, [key_id], [signed], [expiration], subkeys=[subkey])
    return pinged is not None, None if stored is None else list(stored)


@pytest.mark.multipeer
def test_without_the_key_no_record_is_written(tmp_path: Path) -> None:
    key = _key()
    first = _node(key)
    nodes, outsiders = [first], []
    try:
        maddrs = first.visible_maddrs()
        nodes.append(_node(key, maddrs))
        wait_until(lambda: len(first.members()) == 2, timeout=20, what="both keyed peers to be listed")
        for other in (None, _key()):
            with pytest.raises(NetworkError, match="could not join"):
                _node(other, maddrs)
        pushes = {}
        for name, authorizer in (("none", None), ("wrong", SharedKeyAuthorizer(_key()))):
            dht, subkey = _outsider(maddrs, authorizer, tmp_path / f"{name}.key")
            outsiders.append(dht)
            push = functools.partial(_push_record, target=first.peer_id, subkey=subkey)
            pushes[dht.peer_id.to_base58()] = dht.run_coroutine(push)
        assert set(pushes.values()) == {(False, None)}, pushes  # ping and store refused
        # the same push from a peer with the key is accepted and listed: the refusals above are the key's
        member, subkey = _outsider(maddrs, SharedKeyAuthorizer(key), tmp_path / "member.key")
        outsiders.append(member)
        push = functools.partial(_push_record, target=first.peer_id, subkey=subkey)
        assert member.run_coroutine(push) == (True, [True])
        wait_until(
            lambda: member.peer_id.to_base58() in {m.peer_id for m in first.members()},
            timeout=20,
            what="the keyed push to be listed",
        )
        for node in nodes:
            assert not set(pushes) & {m.peer_id for m in node.members()}
    finally:
        for dht in outsiders:
            dht.shutdown()
        for node in nodes:
            node.close()


def _averager(node_or_dht: object, tensor: torch.Tensor, partners: list[str], **kwargs) -> GossipAverager:
    """An fp32 averager on a node's DHT daemon whose partners are whatever ``partners`` holds at each sync."""
    dht = getattr(node_or_dht, "dht", node_or_dht)
    averager = gossip_averager(
        run_id=RUN,
        dht=dht,
        partner_source=lambda: [PartnerInfo(peer, PROTOCOL_VERSION, "ab12") for peer in partners],
        config_hash="ab12",
        codec="fp32",
        **kwargs,
    )
    averager.set_tensors([tensor])
    return averager


@pytest.mark.multipeer
def test_without_the_key_no_tensor_is_exchanged() -> None:
    with _keyed_pair_and_outsider() as (a, b, outsider):
        averagers = []
        try:
            ta, tb = torch.randn(1000), torch.randn(1000)
            expected = (ta + tb) / 2
            keyless = _averager(outsider, torch.randn(1000), [a.peer_id])
            wrong = _averager(outsider, torch.randn(1000), [a.peer_id], swarm_key=_key(), client_mode=True)
            averagers += [keyless, wrong]
            # the keyed averagers take the key from their node's DHT
            a_partners = [b.peer_id]
            av_a = _averager(a, ta, a_partners)
            av_b = _averager(b, tb, [a.peer_id])
            averagers += [av_a, av_b]

            result = av_b.sync()
            assert result.outcome is SyncOutcome.OK, result
            # the server commits when the initiator's final ACK arrives, a moment after sync() returned
            wait_until(lambda: av_a.metrics().exchanges_ok == 1, 10, "the serving side to commit")
            with av_a.paused():
                assert torch.allclose(ta, expected) and torch.allclose(tb, expected)
            before = ta.clone()
            for outsider_averager in (keyless, wrong):
                result = outsider_averager.sync()
                assert result.outcome is SyncOutcome.FAILED, result
                assert torch.equal(ta, before)
            assert "wrong swarm key proof" in result.reason, result
            a_partners[:] = [keyless.peer_id]  # and a keyed initiator gets nothing from a keyless peer
            result = av_a.sync()
            assert result.outcome is SyncOutcome.FAILED and "swarm key" in result.reason, result
            assert torch.equal(ta, before)
            assert av_a.metrics().exchanges_ok == 1
        finally:
            for averager in averagers:
                averager.close()


@pytest.mark.multipeer
def test_without_the_key_no_state_is_downloaded(caplog: pytest.LogCaptureFixture) -> None:
    with _keyed_pair_and_outsider() as (a, b, outsider):
        snapshot = make_snapshot({"w": torch.randn(64, 64)}, {"step": 7}, chunk_bytes=4096)
        with StateServer(a.dht, RUN) as server:  # takes the key from the node's DHT
            server.publish(snapshot)
            donors, trusted = [(server.peer_id, snapshot.digest)], {server.peer_id}
            # without a key the client only sees the donor hang up; the donor logs why
            with (
                caplog.at_level(logging.WARNING, logger="swarm.state"),
                pytest.raises(StateTransferError, match=f"donor {server.peer_id}"),
            ):
                download_state(outsider, donors, run_id=RUN, trusted=trusted, timeout_s=20)
            refusal = f"refused state request from {outsider.peer_id.to_base58()}: swarm key handshake"
            assert refusal in caplog.text
            with pytest.raises(StateTransferError, match=f"donor {server.peer_id}.*wrong swarm key proof"):
                download_state(outsider, donors, run_id=RUN, trusted=trusted, timeout_s=20, swarm_key=_key())
            assert server.stats().requests == 0  # nothing was read from them past the handshake
            got = download_state(b.dht, donors, run_id=RUN, trusted=trusted, timeout_s=20)
            assert got.digest == snapshot.digest and torch.equal(got.tensors["w"], snapshot.tensors["w"])
            assert server.stats().requests == 1


def test_without_the_key_no_dial_back_is_answered() -> None:
    """The reachability checker every node runs answers only askers that hold the swarm key."""
    with _keyed_pair_and_outsider() as (a, b, outsider):
        wait_until(lambda: b.peer_id in {m.peer_id for m in a.members()}, 30, "a lists b")
        addresses = b.visible_maddrs()
        stranger = check_reachability(outsider, RUN, [a.peer_id], addresses, timeout_s=30)
        assert stranger.status == "unknown" and not stranger.answered_by, stranger
        assert "refused" not in " ".join(stranger.errors)  # cut off at the handshake, before the request
        wrong = check_reachability(outsider, RUN, [a.peer_id], addresses, timeout_s=30, swarm_key=_key())
        assert wrong.status == "unknown" and "wrong swarm key proof" in " ".join(wrong.errors), wrong
        member = check_reachability(b.dht, RUN, [a.peer_id], addresses, timeout_s=30)
        assert member.status == "direct" and member.answered_by == (a.peer_id,), member
