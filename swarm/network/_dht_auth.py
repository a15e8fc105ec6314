"""Shared-secret authentication of every DHT RPC of a private swarm (HMAC-SHA256, hivemind's authorizer).

hivemind's ``DHTProtocol`` wraps each RPC in an :class:`~hivemind.utils.auth.AuthorizerBase`: the client
signs the request, the server validates it (an invalid request is dropped before the DHT sees it, so
nothing is stored, no routing table changes), signs its response, and the client validates that.
hivemind's own ``TokenAuthorizerBase`` needs a central authority; a private swarm has only a shared
key, so here every request and response carries an HMAC under a sub-key of the swarm key.

Request: ``auth.time`` (wall clock) and a random 16-byte ``auth.nonce``, then ``auth.signature`` =
HMAC over the message type and the whole serialized request (signature field empty). A request is
refused if its MAC is wrong, its time is more than ``max_skew_s`` away from ours, or its nonce was
already seen within that window (replay). Response: ``auth.nonce`` = the request's nonce, MAC over the
response, so a response only answers the request it was made for.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from swarm.network._swarm_key import SwarmKey

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
MAX_SKEW_S = 60.0
"""How far a request's timestamp may be from our clock; also how long its nonce is remembered (x2)."""
MAX_REMEMBERED_NONCES = 1_000_000
LOG_EVERY_S = 30.0


class SharedKeyAuthorizer(AuthorizerBase):
    """Signs and checks DHT requests and responses with a key every member of a private swarm holds."""

    def __init__(
        self, key: SwarmKey, *, max_skew_s: float = MAX_SKEW_S, clock: Callable[[], float] = get_dht_time
    ) -> None:
        self._mac_key = key.derive("dht-rpc-v1")
        self._max_skew = max_skew_s
        self._clock = clock
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten; insertion-ordered
        self._rejected = 0
        self._last_log = float("-inf")

    def __repr__(self) -> str:
        return "SharedKeyAuthorizer(<redacted>)"

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = self._clock()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = b""
        auth.signature = self._mac(b"request", request)

    async def validate_request(self, request: Any) -> bool:
        reason = self.check_request(request)
        if reason is not None:
            self._log_rejection(type(request).__name__, reason)
        return reason is None

    async def sign_response(self, response: Any, request: Any) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(b"response", response)

    async def validate_response(self, response: Any, request: Any) -> bool:
        auth = response.auth
        if not self._verify(b"response", response):
            self._log_rejection(type(response).__name__, "bad or missing swarm key signature")
            return False
        if not hmac.compare_digest(auth.nonce, request.auth.nonce):
            self._log_rejection(type(response).__name__, "answers another request")
            return False
        return True

    def check_request(self, request: Any) -> str | None:
        """Why ``request`` is refused, or None (then its nonce is remembered as used)."""
        auth = request.auth
        if not self._verify(b"request", request):
            return "bad or missing swarm key signature (a peer without the key, or with another one)"
        now = self._clock()
        if abs(auth.time - now) > self._max_skew:
            return f"timestamp is {auth.time - now:+.0f}s from our clock (allowed: {self._max_skew:.0f}s)"
        if len(auth.nonce) != NONCE_BYTES:
            return "malformed nonce"
        self._forget_old(now)
        if auth.nonce in self._seen:
            return "replayed (nonce already used)"
        self._seen[auth.nonce] = now + 2 * self._max_skew
        return None

    def _mac(self, direction: bytes, message: Any) -> bytes:
        body = message.SerializeToString(deterministic=True)
        header = direction + b"\0" + message.DESCRIPTOR.full_name.encode() + b"\0"
        return hmac.new(self._mac_key, header + body, hashlib.sha256).digest()

    def _verify(self, direction: bytes, message: Any) -> bool:
        """Check the MAC of ``message``; leaves its signature field as it was."""
        auth = message.auth
        signature = auth.signature
        auth.signature = b""
        try:
            return hmac.compare_digest(signature, self._mac(direction, message))
        finally:
            auth.signature = signature

    def _forget_old(self, now: float) -> None:
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until > now and len(self._seen) < MAX_REMEMBERED_NONCES:
                break
            del self._seen[nonce]

    def _log_rejection(self, what: str, reason: str) -> None:
        """At most one line per LOG_EVERY_S: a keyless peer retries often and must not flood the log."""
        self._rejected += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            logger.warning("refused a DHT %s: %s (%d refused so far)", what, reason, self._rejected)
