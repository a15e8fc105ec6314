"""The exchange's data phase streams (swarm.gossip._exchange, _mixing): our tensors may be computed as
they are read, an exchange whose offer changed under it stops without blaming anyone, a partner
whose share is negligible (a joiner taking over) leaves us unchanged and costs no memory, and one
whose frames are not what the agreed codec and schema need is refused as bad data."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from swarm.compression import ErrorFeedback, LazyTensors, encode_tensors, get_codec
from swarm.gossip._exchange import ExchangeSpec, NotCommitted, Settled, run_exchange, settle
from swarm.gossip._gate import ExchangeGate, Turn
from swarm.gossip._metrics import SyncOutcome
from swarm.gossip._mixing import MixedTensors
from swarm.gossip._protocol import Channel, MsgKind
from swarm.gossip._validation import NormPolicy
from tests._channels import channel_pair

NAMES = [f"t{i}" for i in range(6)]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(64, 32, generator=g) for name in NAMES}


def _spec(codec: str = "int8") -> ExchangeSpec:
    return ExchangeSpec(codec=get_codec(codec, 64), chunk_bytes=2048, policy=NormPolicy())


def test_an_exchange_whose_offer_changes_under_it_stops_at_once_and_blames_nobody() -> None:
    """Our tensors are computed from live state (a LazyTensors); when that state starts to change (an
    exchange committed: the gate's generation moved) while our frames go out, we stop before the next
    frame, and both sides end not committed, with nobody to blame."""
    ours, theirs = _tensors(0), _tensors(1)
    gate = ExchangeGate()
    turn = Turn(gate, gate.generation())
    computed: list[str] = []

    def compute(name: str) -> torch.Tensor:
        computed.append(name)
        if name == NAMES[2]:
            gate.changed()  # an update is about to be applied: what we offer is going
        return ours[name].clone()

    lazy = LazyTensors({n: (tuple(t.shape), t.dtype) for n, t in ours.items()}, compute)

    async def scenario() -> list:
        a, b = await channel_pair()
        try:
            return list(
                await asyncio.gather(
                    settle(run_exchange(a, lazy, (1.0, 1.0), _spec(), None, turn=turn), 30.0, "b"),
                    settle(run_exchange(b, theirs, (1.0, 1.0), _spec(), None), 30.0, "a"),
                )
            )
        finally:
            a.close()
            b.close()

    ended = asyncio.run(scenario())
    for side in ended:
        assert side.outcome is SyncOutcome.FAILED and "not committed" in side.reason, side
        assert not side.blame_partner and not side.bad_data
    assert computed == NAMES[:3]  # nothing after the change was even computed


def test_a_stale_turn_refuses_to_validate_what_it_measured() -> None:
    """A check of the partner's data against our tensors is no verdict once they may have changed:
    run_exchange ends NotCommitted instead of rejecting (and banning) an honest partner."""
    ours, theirs = _tensors(0), {n: t * 1000 for n, t in _tensors(1).items()}  # implausible vs ours
    gate = ExchangeGate()
    turn = Turn(gate, gate.generation())
    gate.changed()

    async def scenario() -> list:
        a, b = await channel_pair()
        try:
            return list(
                await asyncio.gather(
                    run_exchange(a, ours, (1.0, 1.0), _spec("fp32"), None, turn=turn),
                    run_exchange(b, theirs, (1.0, 1.0), _spec("fp32"), None),
                    return_exceptions=True,
                )
            )
        finally:
            a.close()
            b.close()

    ours_ended, theirs_ended = asyncio.run(scenario())
    assert isinstance(ours_ended, NotCommitted), ours_ended
    assert isinstance(theirs_ended, NotCommitted), theirs_ended


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_a_joiner_taking_over_leaves_us_unchanged_and_gets_our_values(codec: str) -> None:
    """The joiner (weight 1e-9) ends on our values up to the codec; we end on ours exactly, with a mix
    that is marked unchanged (so the offerer queues nothing), and error feedback is left alone."""
    ours, seed = _tensors(0), _tensors(7)
    feedback = ErrorFeedback(get_codec(codec, 64))

    async def scenario() -> list:
        a, b = await channel_pair()
        try:
            return list(
                await asyncio.gather(
                    run_exchange(a, ours, (1.0, 1e-9), _spec(codec), feedback),
                    run_exchange(b, seed, (1e-9, 1.0), _spec(codec), None),
                )
            )
        finally:
            a.close()
            b.close()

    server, joiner = asyncio.run(scenario())
    assert isinstance(server.tensors, MixedTensors) and server.tensors.unchanged
    assert all(torch.equal(server.tensors[n], ours[n]) for n in NAMES)
    step = max(float(t.abs().max()) for t in ours.values()) / 100
    assert all(float((joiner.tensors[n] - ours[n]).abs().max()) < step for n in NAMES)
    assert not joiner.tensors.unchanged
    server.tensors.fold_all()
    assert all(feedback.residual(n) is None for n in NAMES)  # nothing to fold into our residuals


def _settle_pair(
    ours: dict[str, torch.Tensor],
    spec: ExchangeSpec,
    theirs: dict[str, torch.Tensor],
    their_spec: ExchangeSpec,
) -> Settled:
    """How our side of an exchange with a partner that streams with ``their_spec`` ends."""

    async def scenario() -> Settled:
        a, b = await channel_pair()
        try:
            ended = await asyncio.gather(
                settle(run_exchange(a, ours, (1.0, 1.0), spec, None), 30.0, "b"),
                settle(run_exchange(b, theirs, (1.0, 1.0), their_spec, None), 30.0, "a"),
            )
            return ended[0]
        finally:
            a.close()
            b.close()

    return asyncio.run(scenario())


def _small(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(64 * 64, generator=torch.Generator().manual_seed(seed))}


async def _streams_regardless(channel: Channel, tensors: dict[str, torch.Tensor], spec: ExchangeSpec) -> None:
    """A partner that streams its frames in ``spec`` whatever was agreed, and never judges ours. (An
    honest run_exchange in another codec would refuse our frames too, and its NACK may reach us
    before we read its first frame.)"""
    frames = list(encode_tensors(tensors, spec.codec, spec.chunk_bytes))
    for frame in frames:
        await channel.send(MsgKind.DATA, frame)
    await channel.send_json(MsgKind.END, {"frames": len(frames)})
    with contextlib.suppress(Exception):
        while True:
            await channel.recv()


def test_tiny_fp32_frames_under_an_int8_agreement_are_bad_data() -> None:
    """A partner that agreed on int8 streams one-element fp32 frames (65 bytes each, for 4 bytes of
    payload): its first frame is refused as bad data, which bans it at once."""
    spec = ExchangeSpec(codec=get_codec("int8", 64), chunk_bytes=4096, policy=NormPolicy())
    tiny = ExchangeSpec(codec=get_codec("fp32"), chunk_bytes=65, policy=NormPolicy())

    async def scenario() -> Settled:
        ours, theirs = await channel_pair()
        partner = asyncio.create_task(_streams_regardless(theirs, _small(1), tiny))
        try:
            return await settle(run_exchange(ours, _small(0), (1.0, 1.0), spec, None), 30.0, "b")
        finally:
            ours.close()
            theirs.close()
            partner.cancel()

    ended = asyncio.run(scenario())
    assert ended.outcome is SyncOutcome.REJECTED and ended.bad_data, ended
    assert "codec: a frame in fp32" in ended.reason


def test_more_frames_than_the_schema_needs_are_bad_data() -> None:
    """In the agreed codec but one block a frame (64 frames where 4096-byte chunks need 2): the first
    frame's chunk count is refused as bad data, before anything is kept."""
    flood = ExchangeSpec(codec=get_codec("int8", 64), chunk_bytes=61 + 68, policy=NormPolicy())
    spec = ExchangeSpec(codec=get_codec("int8", 64), chunk_bytes=4096, policy=NormPolicy())
    ended = _settle_pair(_small(0), spec, _small(1), flood)
    assert ended.outcome is SyncOutcome.REJECTED and ended.bad_data, ended
    assert "chunk count: 64 not in [1, 2]" in ended.reason
    honest = _settle_pair(_small(0), spec, _small(1), spec)
    assert honest.outcome is SyncOutcome.OK, honest
