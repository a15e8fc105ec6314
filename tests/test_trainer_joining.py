"""What a joiner accepts from a donor's state beyond the verified frames (its meta and its size), and
the state a trainer serves: its progress, its precision, and its digest after a takeover."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import FrameError, TensorStreamDecoder, encode_tensors, get_codec
from swarm.learning import OuterOptimizer
from swarm.state import StateTransferError
from swarm.trainer._joining import adopt, progress_of, publish_state, snapshot_of, state_limits
from swarm.trainer._progress import Progress


def test_progress_of_takes_the_counters_of_an_honest_meta() -> None:
    meta = {"round": 3, "step": 60, "samples_total": 960, "extra": "ignored"}
    assert progress_of(meta) == {"round": 3, "step": 60, "samples_total": 960}
    assert progress_of({}) == {"round": 0, "step": 0, "samples_total": 0}


@pytest.mark.parametrize("value", ["x", [1], 1.5, -1, True, None, 2**63, {"a": 1}])
def test_progress_of_refuses_a_hostile_counter_by_name(value: object) -> None:
    with pytest.raises(StateTransferError, match="samples_total"):
        progress_of({"round": 1, "step": 1, "samples_total": value})


def test_state_limits_refuse_a_tensor_larger_than_any_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    limits = state_limits(model)
    codec = get_codec("fp32")
    fits = [("w", torch.zeros(4, 8))]
    TensorStreamDecoder(limits=limits).feed(next(iter(encode_tensors(fits, codec, chunk_bytes=1 << 16))))
    too_big = [("w", torch.zeros(64, 8))]
    with pytest.raises(FrameError):
        decoder = TensorStreamDecoder(limits=limits)
        for frame in encode_tensors(too_big, codec, chunk_bytes=1 << 16):
            decoder.feed(frame)


def test_a_joined_peer_serves_the_progress_of_the_state_it_took_over_plus_its_own() -> None:
    outer = OuterOptimizer(torch.nn.Linear(2, 2), lr=0.7, momentum=0.9)
    own = Progress(step=5, round=1, samples_total=80)
    joined = {"round": 6, "step": 46, "samples_total": 736}
    with snapshot_of(outer, own, joined) as served:
        assert progress_of(served.meta) == {"round": 7, "step": 51, "samples_total": 816}
    # the first peer of a swarm (or a resumed one) took over nothing: its own counters
    with snapshot_of(outer, own) as served:
        assert progress_of(served.meta) == {"round": 1, "step": 5, "samples_total": 80}


def _trained_outer(seed: int) -> tuple[torch.nn.Module, OuterOptimizer]:
    """A model and its outer optimizer after one outer step: full-precision anchor and momentum."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    outer = OuterOptimizer(model, lr=0.7, momentum=0.9)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    outer.apply(outer.pseudo_gradient())
    assert outer.momentum_buffers
    return model, outer


def test_a_joiner_gets_the_state_at_bf16_precision_and_serves_the_same_digest_until_it_trains() -> None:
    """A joiner receives each anchor and momentum value rounded to bf16 (relative error at most 2^-8);
    re-encoding those values is exact, so the state it serves right after the takeover is the one it
    took over, digest and all."""
    donor_model, donor = _trained_outer(0)
    donor_progress = Progress(step=5, round=1, samples_total=80)
    joiner_model, joiner = _trained_outer(1)
    with snapshot_of(donor, donor_progress) as served:
        state = served.decode(state_limits(donor_model))
        assert state.digest == served.digest
        decoded = dict(state.tensors)
        with pytest.raises(ValueError, match="does not match this model"):
            adopt(torch.nn.Linear(16, 8), OuterOptimizer(torch.nn.Linear(16, 8), lr=0.7, momentum=0.9), state)
        assert state.tensors == decoded  # refused: untouched
        adopt(joiner_model, joiner, state)
        assert state.tensors == {}  # taken over: the momentum is the decoded tensor, not a copy
        assert all(t is decoded[f"momentum/{n}"] for n, t in joiner.momentum_buffers.items())
        with snapshot_of(joiner, Progress(), progress_of(state.meta)) as again:
            assert again.digest == served.digest
    for name in donor.anchor:
        for theirs, ours in (
            (donor.anchor, joiner.anchor),
            (donor.momentum_buffers, joiner.momentum_buffers),
        ):
            exact, received = theirs[name], ours[name]
            assert torch.equal(received, exact.bfloat16().float()), name
            assert bool(((received - exact).abs() <= exact.abs() * 2**-8).all()), name
            assert not torch.equal(received, exact), name  # really rounded: the test can tell
        assert torch.equal(dict(joiner_model.named_parameters())[name].detach(), joiner.anchor[name])


class _Server:
    """Stands in for a StateServer: keeps what is published (and closes what it replaces)."""

    def __init__(self) -> None:
        self.published: list = []

    def publish(self, state) -> None:
        self.published.append(state)

    def can_publish(self) -> bool:
        return True


def test_a_state_that_cannot_be_spooled_is_not_published_and_the_previous_one_stays(tmp_path, caplog) -> None:
    """The spool goes next to the checkpoints (made if missing, ``~`` expanded); a disk that refuses
    it costs this round's publication, with a warning, never the trainer."""
    _, outer = _trained_outer(2)
    server = _Server()
    directory = tmp_path / "not-yet" / "checkpoints"
    digest = publish_state(server, outer, Progress(step=1), None, str(directory))
    assert digest == server.published[0].digest and directory.is_dir()
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    assert publish_state(server, outer, Progress(step=2), None, str(blocked / "checkpoints")) is None
    assert len(server.published) == 1 and "not publishing our state this round" in caplog.text
    for state in server.published:
        state.close()
