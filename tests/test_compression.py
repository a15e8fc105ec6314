"""Codecs against plain torch references, backend agreement, sizes, edge cases."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CODEC_NAMES, get_codec
from swarm.compression import _quantize as kq

BNB = kq.bnb_functional() is not None
needs_bnb = pytest.mark.skipif(not BNB, reason="bitsandbytes is not importable")
SIZES = [0, 1, 2, 63, 64, 65, 127, 1000, 4099]


def ref_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Simple reference: per block, round(x / (absmax / 127)) * absmax / 127."""
    pad = (-x.numel()) % block
    v = torch.cat([x, torch.zeros(pad)]).view(-1, block)
    absmax = v.abs().amax(dim=1, keepdim=True).clamp_min(kq.TINY_SCALE)
    step = absmax / 127
    return (torch.round(v / step) * step).view(-1)[: x.numel()]


def ref_nf4(x: torch.Tensor, block: int) -> torch.Tensor:
    """Simple reference: nearest NF4 level (bucketize on midpoints) of x / bf16-rounded-up absmax."""
    levels = torch.tensor(kq.NF4_LEVELS)
    pad = (-x.numel()) % block
    v = torch.cat([x, torch.zeros(pad)]).view(-1, block)
    absmax = v.abs().amax(dim=1, keepdim=True).clamp_min(kq.TINY_SCALE)
    scale = absmax.to(torch.bfloat16).float()
    scale = torch.where(
        scale < absmax, torch.nextafter(scale.bfloat16(), torch.tensor(1e38).bfloat16()).float(), scale
    )
    idx = torch.bucketize(v / scale, (levels[:-1] + levels[1:]) / 2)
    return (levels[idx] * scale).view(-1)[: x.numel()]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [16, 64, 256])
def test_int8_torch_matches_reference_exactly(n: int, block: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    out = get_codec("int8", block, backend="torch").roundtrip(x)
    assert torch.equal(out, ref_int8(x, block))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [16, 64, 256])
def test_int4_torch_matches_reference_exactly(n: int, block: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    out = get_codec("int4", block, backend="torch").roundtrip(x)
    assert torch.equal(out, ref_nf4(x, block))


def test_nf4_levels_match_bitsandbytes() -> None:
    if not BNB:
        pytest.skip("bitsandbytes is not importable")
    bnb_levels = kq.bnb_functional().get_4bit_type("nf4", device="cpu")
    assert torch.equal(bnb_levels, torch.tensor(kq.NF4_LEVELS))


def test_nf4_fine_grid_never_misplaces_a_value_near_a_midpoint() -> None:
    levels = torch.tensor(kq.NF4_LEVELS)
    mids = (levels[:-1] + levels[1:]) / 2
    eps = torch.tensor([-2e-7, -1e-7, 0.0, 1e-7, 2e-7])
    y = (mids[:, None] + eps[None, :]).reshape(-1).clamp(-1, 1)
    x = torch.cat([y, torch.tensor([1.0])])  # the 1.0 pins the block scale to exactly 1
    out = get_codec("int4", 16, backend="torch").roundtrip(x)
    assert torch.equal(out, ref_nf4(x, 16))


@needs_bnb
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 64, 1000, 65536 + 7])
def test_bnb_and_torch_backends_agree(name: str, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    torch_codec, bnb_codec = get_codec(name, 64, "torch"), get_codec(name, 64, "bnb")
    a, b = torch_codec.roundtrip(x), bnb_codec.roundtrip(x)
    # same scheme, independently rounded: at most one quantization step apart, rarely; for int4
    # bnb's fp32 block scale is rounded to bf16 on the wire (<= 2**-8 relative, < `noise`)
    step = (0.02 if name == "int8" else 0.35) * x.abs().max()
    noise = (1e-6 if name == "int8" else 0.01) * x.abs().max()
    assert float((a - b).abs().max()) <= step
    assert float(((a - b).abs() > noise).float().mean()) < (0.01 if name == "int8" else 0.05)
    # and either backend decodes the other's wire representation
    e = bnb_codec.encode(x)
    assert torch.allclose(torch_codec.decode(e), bnb_codec.decode(e), atol=1e-6)
    assert rel_err(a, x) < (0.01 if name == "int8" else 0.12)


def test_error_levels_per_codec() -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    bounds = {"fp32": 0.0, "fp16": 1e-3, "bf16": 5e-3, "int8": 0.01, "int4": 0.12}
    for name in CODEC_NAMES:
        assert rel_err(get_codec(name).roundtrip(x), x) <= bounds[name], name


def test_int4_bytes_per_param_under_target() -> None:
    n = 1 << 20
    e = get_codec("int4", 64).encode(torch.randn(n))
    assert e.nbytes / n <= 0.55
    assert e.data.numel() == n // 2 and e.scales is not None and e.scales.dtype == torch.bfloat16


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("shape", [(0,), (1,), (), (3, 0, 2), (7, 13), (2, 3, 65)])
def test_roundtrip_shapes(name: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    out = get_codec(name, 16).roundtrip(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    if x.numel():
        assert rel_err(out, x) < 0.2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_input_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(300).to(dtype)
    e = get_codec("int8").encode(x)
    assert e.dtype == dtype
    assert rel_err(get_codec("int8").decode(e), x.float()) < 0.01


def test_zero_and_tiny_blocks_decode_finite() -> None:
    x = torch.cat([torch.zeros(64), torch.full((64,), 1e-39), torch.full((64,), -3e-38)])
    for name in ("int8", "int4"):
        out = get_codec(name).roundtrip(x)
        assert torch.isfinite(out).all()
        assert torch.equal(out[:64], torch.zeros(64))
        assert float((out - x).abs().max()) < 1e-37


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_is_refused(name: str, bad: float) -> None:
    x = torch.randn(200)
    x[77] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        get_codec(name).encode(x)


def test_fp16_overflow_is_refused() -> None:
    with pytest.raises(ValueError, match="NaN/Inf"):
        get_codec("fp16").encode(torch.tensor([1.0, 1e6]))


def test_get_codec_validation() -> None:
    with pytest.raises(ValueError, match="int3"):
        get_codec("int3")
    with pytest.raises(ValueError, match="block_size"):
        get_codec("int8", block_size=48)
    with pytest.raises(ValueError, match="backend"):
        get_codec("int8", backend="gpu")
    if BNB:
        with pytest.raises(ValueError, match="bnb"):
            get_codec("int8", block_size=32, backend="bnb")


def test_decode_rejects_foreign_encoding() -> None:
    e = get_codec("int8").encode(torch.randn(10))
    with pytest.raises(ValueError, match="int8"):
        get_codec("int4").decode(e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")
@pytest.mark.parametrize("name", ["int8", "int4", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_matches_the_cpu_reference(name: str, dtype: torch.dtype) -> None:
    """On CUDA, "auto" picks the GPU kernels; the result agrees with the CPU torch path on the same input."""
    x = torch.randn(65536 + 7, generator=torch.Generator().manual_seed(3)).to(dtype)
    gpu, cpu = get_codec(name, 64, "auto"), get_codec(name, 64, "torch")
    encoded = gpu.encode(x.cuda())
    on_gpu = gpu.decode(encoded).cpu()
    on_cpu = cpu.roundtrip(x)
    step = {"int8": 0.02, "int4": 0.35, "fp16": 1e-3, "bf16": 1e-2}[name] * float(x.abs().max())
    assert float((on_gpu - on_cpu).abs().max()) <= step
    assert rel_err(on_gpu, x.float()) < {"int8": 0.01, "int4": 0.12, "fp16": 1e-3, "bf16": 5e-3}[name]
    assert torch.allclose(cpu.decode(encoded.cpu()), on_gpu, atol=1e-6)  # the wire form is device-free
