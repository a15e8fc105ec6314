"""Exchange deadlines that grow with the exchange's size over the rate measured to each partner.

A fixed bound on a whole exchange is wrong both ways: on a slow home link a large model's exchange
takes minutes and a 30 s bound drops every one of them, while on a fast link a bound sized for the slow
case lets a slow-dripping partner hold the exchange lock for minutes. So the averager bounds each
exchange by ``margin x bytes / rate``, where ``rate`` is what the last exchanges with that partner
achieved, within ``[floor_s, cap_s]``. A partner never measured is given the median rate measured to
the others (this peer's own link is often the bottleneck; one slow-dripping partner cannot stretch
everyone's deadline), or :data:`PRIOR_RATE_BYTES_S` before any measurement. A partner that stalls
is dropped by the framing when nothing moves for ``chunk_timeout_s`` (:class:`swarm.p2p.StalledError`),
and one that trickles (a piece every few seconds) by the rate floor (:func:`rate_floor`), whatever
the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from swarm.compression import schema_of

if TYPE_CHECKING:
    import torch

    from swarm.compression import Codec
    from swarm.gossip._protocol import Channel

T = TypeVar("T")

PRIOR_RATE_BYTES_S = 125_000.0
"""The rate assumed before any exchange was measured: 1 Mbit/s, a slow home uplink."""

MIN_MEASURED_BYTES = 64 * 1024
"""Exchanges that moved less than this (a rejected handshake, a tiny model) measure latency, not rate."""

SMOOTHING = 0.5
"""Weight of the newest measurement in a partner's rate (exponential moving average)."""

MAX_PARTNERS = 1024
"""Partners whose rate is remembered (least recently measured forgotten first)."""


class Deadlines:
    """How long one exchange with a given partner may take, learnt from the exchanges so far.

    Args:
        floor_s: the shortest deadline (``averaging.exchange_timeout_s``), for small exchanges and fast
            links alike.
        cap_s: the longest (``averaging.max_exchange_timeout_s``).
        margin: the deadline's multiple of the expected transfer time.
    """

    def __init__(self, floor_s: float, cap_s: float, margin: float = 3.0) -> None:
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"need 0 < floor_s <= cap_s, got {floor_s} and {cap_s}")
        if margin < 1:
            raise ValueError(f"margin must be at least 1, got {margin}")
        self.floor_s, self.cap_s, self.margin = floor_s, cap_s, margin
        self._rates: OrderedDict[str, float] = OrderedDict()

    def observe(self, partner: str, nbytes: int, seconds: float) -> None:
        """Record that ``nbytes`` (the larger direction) moved to or from ``partner`` in ``seconds``.

        Called for every exchange that moved data, whether it committed or ran out of time: an
        exchange cut off by a deadline that was too short still measured the link, so the next
        deadline for that partner is right.
        """
        if nbytes < MIN_MEASURED_BYTES or not seconds > 0:
            return
        rate = nbytes / seconds
        old = self._rates.pop(partner, None)
        self._rates[partner] = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old
        while len(self._rates) > MAX_PARTNERS:
            self._rates.popitem(last=False)

    def rate(self, partner: str) -> float:
        """Bytes per second expected with ``partner`` (see the module docstring for the fallbacks)."""
        known = self._rates.get(partner)
        if known is not None:
            return known
        return statistics.median(self._rates.values()) if self._rates else PRIOR_RATE_BYTES_S

    def exchange_s(self, partner: str, nbytes: int) -> float:
        """The deadline of an exchange that moves ``nbytes`` each way with ``partner``."""
        expected = nbytes / self.rate(partner)
        return min(self.cap_s, max(self.floor_s, self.margin * expected))


class SlowPartner(TimeoutError):
    """While data was still due, the partner moved less than the rate floor in one window."""


@dataclass
class Sending:
    """Set by our sender while it waits inside a write, i.e. on the partner to take our bytes: a
    sender that is slow for reasons of its own (encoding under load, a test's stall) is not the
    partner's fault."""

    writing: bool = False


async def rate_floor(
    channel: Channel,
    sender: asyncio.Task[None],
    receiver: asyncio.Task[T],
    floor_bytes_s: float,
    window_s: float,
    sending: Sending,
) -> T:
    """Wait for both transfers; raise :class:`SlowPartner` as soon as one that is still running moved
    less than ``floor_bytes_s * window_s`` bytes in a window (a floor of 0: no check). Only the
    partner's slowness counts: our sending only while ``sending.writing`` (we wait on it to read), our
    receiving only in a window we spent at least half waiting on its bytes (``channel.read_wait_s``),
    not decoding them on a starved CPU.

    A partner that trickles (64 KiB every 10 s passes the framing's stall timeout) is dropped within
    two windows, whatever its deadline: what a transfer costs the other side is bounded by the rate it
    has to keep up, not by what it claims. Both tasks are cancelled if we end early.
    """
    tasks: set[asyncio.Task[Any]] = {sender, receiver}
    budget = floor_bytes_s * window_s
    try:
        while not (sender.done() and receiver.done()):
            before = (channel.bytes_sent, channel.bytes_received)
            waited_before = channel.read_wait_s()
            done, _ = await asyncio.wait(
                [t for t in tasks if not t.done()],
                timeout=window_s,
                return_when=asyncio.FIRST_EXCEPTION,
            )
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if budget <= 0:
                continue
            received, sent = channel.bytes_received - before[1], channel.bytes_sent - before[0]
            waited = channel.read_wait_s() - waited_before
            if not receiver.done() and received < budget and waited >= window_s / 2:
                raise SlowPartner(_too_slow("received", received, floor_bytes_s, window_s))
            if not sender.done() and sending.writing and sent < budget:
                raise SlowPartner(_too_slow("sent", sent, floor_bytes_s, window_s))
        await sender
        return await receiver
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


def _too_slow(what: str, nbytes: int, floor_bytes_s: float, window_s: float) -> str:
    return f"{what} {nbytes} bytes in {window_s:g} s, under the floor of {floor_bytes_s:.0f} bytes/s"


def payload_nbytes(tensors: Mapping[str, torch.Tensor], codec: Codec) -> int:
    """The bytes ``tensors`` take on the wire with ``codec`` (payloads only, one direction)."""
    return sum(codec.payload_nbytes(math.prod(shape)) for shape, _ in schema_of(tensors).values())
