"""Error feedback: bounded accumulated error, commit / discard (rollback), streaming integration."""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.compression import ErrorFeedback, LazyTensors, TensorStreamDecoder, encode_tensors, get_codec


def one_step_error_bound(codec_name: str, scale: float, n: int) -> float:
    """L2 bound on one step's quantization error for inputs of magnitude <= `scale` (generous)."""
    rel = {"fp16": 1e-3, "bf16": 4e-3, "int8": 1 / 127, "int4": 0.3}[codec_name]
    return rel * scale * n**0.5


@settings(max_examples=25, deadline=None)
@given(
    codec_name=st.sampled_from(["int4", "int8", "bf16", "fp16"]),
    steps=st.integers(1, 60),
    n=st.integers(1, 200),
    seed=st.integers(0, 2**31 - 1),
    heavy=st.booleans(),
)
def test_sum_of_decoded_tracks_sum_of_inputs(
    codec_name: str, steps: int, n: int, seed: int, heavy: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    codec = get_codec(codec_name, 16)
    ef = ErrorFeedback(codec)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    scale = 0.0
    for _ in range(steps):
        x = torch.randn(n, generator=g)
        if heavy:
            x = x * torch.exp(2 * torch.randn(n, generator=g))
        total += x.double()
        sent += codec.decode(ef.encode("w", x)).double()
        scale = max(scale, float(x.abs().max()))
    # sum(decoded) = sum(inputs) - final residual, and the residual is one step's error:
    # the gap does not grow with the number of steps
    residual = ef.residual("w")
    assert residual is not None
    assert torch.allclose(total - sent, residual.double(), rtol=1e-4, atol=1e-4 * scale * steps)
    # the residual is the error of quantizing (input + previous residual), itself bounded
    assert float((total - sent).norm()) <= 2 * one_step_error_bound(codec_name, 2 * scale, n) + 1e-6


def test_without_feedback_error_grows_with_feedback_it_does_not() -> None:
    g = torch.Generator().manual_seed(0)
    codec = get_codec("int4", 64)
    ef = ErrorFeedback(codec)
    bias = torch.full((256,), 0.01)  # a small constant component that 4-bit rounding loses
    total = torch.zeros(256)
    plain = torch.zeros(256)
    fed = torch.zeros(256)
    for _ in range(200):
        x = torch.randn(256, generator=g) + bias
        total += x
        plain += codec.roundtrip(x)
        fed += codec.decode(ef.encode("w", x))
    assert float((total - fed).norm()) < 0.5 * float((total - plain).norm())
    assert float((total - fed).norm()) < one_step_error_bound("int4", 5.0, 256)


def test_commit_and_discard() -> None:
    codec = get_codec("int8", 64)
    ef = ErrorFeedback(codec)
    x = torch.randn(1000)
    ef.encode("a", x)  # commit=True by default
    committed = ef.residual("a").clone()
    assert committed.abs().sum() > 0

    # a failed exchange: the attempt's residual is dropped, the committed one is untouched
    ef.encode("a", torch.randn(1000), commit=False)
    assert ef.pending_names() == ["a"]
    assert torch.equal(ef.residual("a"), committed)
    ef.discard_pending()
    assert ef.pending_names() == [] and torch.equal(ef.residual("a"), committed)

    # retrying starts from the committed residual, so it encodes the same thing again
    y = torch.randn(1000)
    e1 = ef.encode("a", y, commit=False)
    e2 = ef.encode("a", y, commit=False)  # replaces the pending one
    assert torch.equal(e1.data, e2.data)
    expected_residual = (y + committed) - codec.decode(e1)
    ef.commit("a")
    assert torch.allclose(ef.residual("a"), expected_residual)
    with pytest.raises(KeyError, match="a"):
        ef.commit("a")

    ef.encode("b", torch.randn(10), commit=False)
    ef.encode("c", torch.randn(10), commit=False)
    ef.commit_all()
    assert ef.residual("b") is not None and ef.residual("c") is not None and ef.pending_names() == []
    ef.reset("b")
    assert ef.residual("b") is None and ef.residual("c") is not None
    ef.reset()
    assert ef.residual("a") is None and ef.residual("c") is None


def test_failed_encode_changes_nothing_and_shape_change_is_refused() -> None:
    ef = ErrorFeedback(get_codec("int8"))
    ef.encode("w", torch.randn(100))
    before = ef.residual("w").clone()
    bad = torch.randn(100)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ef.encode("w", bad)
    assert torch.equal(ef.residual("w"), before) and ef.pending_names() == []
    with pytest.raises(ValueError, match="shape"):
        ef.encode("w", torch.randn(101))


def test_lossless_codec_keeps_no_residual() -> None:
    ef = ErrorFeedback(get_codec("fp32"))
    x = torch.randn(10)
    assert torch.equal(get_codec("fp32").decode(ef.encode("w", x)), x)
    assert ef.residual("w") is None


def test_stream_with_feedback_leaves_residuals_pending_until_commit() -> None:
    codec = get_codec("int4", 64)
    ef = ErrorFeedback(codec)
    tensors = [("a", torch.randn(500)), ("b", torch.randn(7, 9))]
    decoder = TensorStreamDecoder()
    for frame in encode_tensors(tensors, codec, chunk_bytes=256, error_feedback=ef):
        decoder.feed(frame)
    out = decoder.finish()
    assert ef.pending_names() == ["a", "b"] and ef.residual("a") is None
    ef.commit_all()
    for name, t in tensors:
        assert torch.allclose(out[name] + ef.residual(name), t, atol=1e-6)
    frames = list(encode_tensors(tensors, codec, error_feedback=ef, commit_residuals=True))
    assert frames and ef.pending_names() == []


@pytest.mark.parametrize("codec_name", ["int8", "int4", "bf16"])
def test_peek_sends_what_encode_sends_and_a_fold_leaves_what_a_commit_leaves(codec_name: str) -> None:
    """An exchange that keeps no pending residual (peek, then fold once committed) sends the same bytes
    and ends with the same residual as one that encodes with a pending residual and commits it."""
    codec = get_codec(codec_name, 16)
    kept, folded = ErrorFeedback(codec), ErrorFeedback(codec)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(100, generator=g)
        sent = kept.encode("w", x, commit=False)
        peeked = folded.peek("w", x)
        assert torch.equal(codec.decode(sent), codec.decode(peeked))
        assert folded.pending_names() == []  # a peek keeps nothing
        kept.commit_all()
        folded.fold("w", x, codec.decode(folded.peek("w", x)))  # deterministic: peek again at the commit
        torch.testing.assert_close(folded.residual("w"), kept.residual("w"), rtol=0, atol=1e-6)
    assert float(folded.residual("w").abs().max()) > 0  # lossy: something was carried over


def test_encode_tensors_reads_a_lazy_mapping_one_tensor_at_a_time() -> None:
    """Frames of a LazyTensors equal those of the same tensors given at once, and no two of its
    tensors are alive at the same time while they are encoded."""
    values = {f"t{i}": torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(5)}
    live = {"now": 0, "most": 0}

    def released() -> None:
        live["now"] -= 1

    def compute(name: str) -> torch.Tensor:
        out = values[name].clone()
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])
        weakref.finalize(out, released)
        return out

    lazy = LazyTensors({n: (tuple(t.shape), t.dtype) for n, t in values.items()}, compute)
    codec = get_codec("int8", 64)
    expected = list(encode_tensors(list(values.items()), codec, chunk_bytes=256))
    assert list(encode_tensors(lazy, codec, chunk_bytes=256)) == expected
    assert live["most"] == 1
