"""Finding 12 of issue 28: the private swarm key.

* a passphrase goes through scrypt before it is used (the documented construction);
* a connector without the key gets nothing key-dependent back from a peer it connects to (the dialler
  proves first), so it has nothing to test key guesses against offline;
* replayed and reflected (mirrored) handshakes are still refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from pathlib import Path

from swarm.network import SwarmKey, load_swarm_key
from swarm.p2p import AuthError, authenticate_stream

PROTOCOL = "swarm.test.v1"
NONCE, PROOF, REFUSED = 0x61, 0x62, 0x63


def _frame(kind: int, payload: bytes) -> bytes:
    return bytes([kind]) + len(payload).to_bytes(4, "big") + payload


async def _read_frames(reader: asyncio.StreamReader, timeout: float) -> list[tuple[int, bytes]]:
    """Every frame the other side sends until it closes (or ``timeout`` passes)."""
    frames = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                head = await reader.readexactly(5)
                frames.append((head[0], await reader.readexactly(int.from_bytes(head[1:], "big"))))
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        pass
    return frames


class Responder:
    """An honest peer answering handshakes on a loopback port; ``errors`` holds what each one raised."""

    def __init__(self, key: SwarmKey, local: str = "bob", remote: str = "mallory") -> None:
        self.key, self.local, self.remote = key, local, remote
        self.errors: list[BaseException | None] = []
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await authenticate_stream(
                reader,
                writer,
                key=self.key,
                initiator=False,
                protocol=PROTOCOL,
                local_peer=self.local,
                remote_peer=self.remote,
                timeout=3,
            )
            self.errors.append(None)
        except AuthError as exc:
            self.errors.append(exc)
        finally:
            writer.close()
            self.done.set()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


def test_a_passphrase_is_stretched_with_scrypt_and_key_files_keep_working(tmp_path: Path) -> None:
    passphrase = b"correct horse battery staple"
    master = hashlib.scrypt(
        passphrase, salt=b"swarm-key-v2/scrypt", n=2**15, r=8, p=1, maxmem=2**26, dklen=32
    )
    expected = hmac.new(master, b"swarm-key-derive\0purpose", hashlib.sha256).digest()
    assert SwarmKey(passphrase).derive("purpose") == expected
    unstretched = hmac.new(passphrase, b"swarm-key-derive\0purpose", hashlib.sha256).digest()
    assert SwarmKey(passphrase).derive("purpose") != unstretched
    text = secrets.token_hex(32)  # what `swarm config keygen` writes
    path = tmp_path / "swarm.key"
    path.write_text(text + "\n")
    path.chmod(0o600)
    assert load_swarm_key(path, {}) == load_swarm_key(None, {"SWARM_KEY": text}) == SwarmKey(text.encode())


def test_a_connector_without_the_key_gets_nothing_to_guess_against() -> None:
    async def scenario() -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], Responder]:
        responder = Responder(SwarmKey(secrets.token_hex(32).encode()))
        async with responder as port:
            # 1. open and wait: the peer sends its nonce, and nothing else
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            silent = await _read_frames(reader, timeout=1.0)
            writer.close()
            # 2. follow the protocol with a guessed proof: still nothing keyed comes back
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_frame(NONCE, secrets.token_bytes(32)) + _frame(PROOF, secrets.token_bytes(32)))
            await writer.drain()
            guessing = await _read_frames(reader, timeout=5.0)
            writer.close()
            await asyncio.wait_for(responder.done.wait(), 10)
        return silent, guessing, responder

    silent, guessing, responder = asyncio.run(scenario())
    assert [kind for kind, _ in silent] in ([], [NONCE])  # a random nonce at most
    # a random nonce, then an empty "refused": no proof, nothing computed from the key
    assert guessing == [(NONCE, guessing[0][1]), (REFUSED, b"")] and len(guessing[0][1]) == 32, guessing
    assert any(isinstance(e, AuthError) and "wrong swarm key proof" in str(e) for e in responder.errors)


def test_a_recorded_handshake_replayed_is_refused() -> None:
    key = SwarmKey(secrets.token_hex(32).encode())

    async def scenario() -> Responder:
        responder = Responder(key, remote="alice")
        async with responder as port:
            recorded = bytearray()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            original_write = writer.write

            def tap(data: bytes) -> None:
                recorded.extend(data)
                original_write(data)

            writer.write = tap  # type: ignore[method-assign]
            await authenticate_stream(
                reader, writer, key=key, initiator=True, protocol=PROTOCOL,
                local_peer="alice", remote_peer="bob", timeout=3,
            )  # fmt: skip
            writer.close()
            responder.done.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(bytes(recorded))  # the same nonce and proof again
            await writer.drain()
            await _read_frames(reader, timeout=5.0)
            writer.close()
            await asyncio.wait_for(responder.done.wait(), 10)
        return responder

    responder = asyncio.run(scenario())
    assert responder.errors[0] is None  # the honest handshake
    assert isinstance(responder.errors[1], AuthError) and "wrong swarm key proof" in str(responder.errors[1])


def test_a_mirrored_handshake_is_refused() -> None:
    """Mallory, dialled by Bob, opens a stream back to Bob and mirrors each side's messages into the
    other, so that Bob would answer his own challenge."""
    key = SwarmKey(secrets.token_hex(32).encode())

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(4096):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def scenario() -> tuple[BaseException | None, Responder]:
        bob_serving = Responder(key, local="bob", remote="mallory")
        async with bob_serving as bob_port:

            async def mallory(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                back_reader, back_writer = await asyncio.open_connection("127.0.0.1", bob_port)
                await asyncio.gather(pipe(reader, back_writer), pipe(back_reader, writer))

            mallory_server = await asyncio.start_server(mallory, "127.0.0.1", 0)
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", mallory_server.sockets[0].getsockname()[1]
            )
            try:
                await authenticate_stream(
                    reader, writer, key=key, initiator=True, protocol=PROTOCOL,
                    local_peer="bob", remote_peer="mallory", timeout=3,
                )  # fmt: skip
                dialling: BaseException | None = None
            except AuthError as exc:
                dialling = exc
            writer.close()
            await asyncio.wait_for(bob_serving.done.wait(), 10)
            mallory_server.close()
        return dialling, bob_serving

    dialling, serving = asyncio.run(scenario())
    assert isinstance(dialling, AuthError)
    assert isinstance(serving.errors[0], AuthError) and "wrong swarm key proof" in str(serving.errors[0])
