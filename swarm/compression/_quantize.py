"""Blockwise quantization kernels: a vectorized torch path and a bitsandbytes path.

Two schemes, chosen by measurement (see docs/compression.md):

* int8: symmetric absmax-linear. Per block of `block` values, `absmax` (fp32) is stored and each
  value becomes ``round(x / (absmax / 127))`` in [-127, 127] (an ordinary int8).
* int4: NF4 (the 16 normal-quantile levels of QLoRA). Per block the scale is `absmax` rounded *up*
  to bfloat16 (2 bytes; this is what keeps int4 under 0.55 bytes/parameter at block 64), each value
  becomes the index of the nearest NF4 level of ``x / scale``, two indices per byte, first value
  in the high nibble (the same layout bitsandbytes uses).

Both paths write the same wire representation, so a peer decoding with one backend reads what a
peer encoded with the other. All functions take and return flat (1-D) contiguous tensors.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch

logger = logging.getLogger(__name__)

Backend = Literal["torch", "bnb"]

BNB_BLOCK_SIZES = frozenset((64, 128, 256, 512, 1024, 2048, 4096))
# Smallest stored scale: keeps x / scale finite for all-zero or subnormal blocks.
TINY_SCALE = 1e-30
# Elements processed per step on CPU: temporaries stay in cache and are reused.
_CPU_CHUNK = 1 << 17

NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# Cells per unit of the fine grid used to find the nearest NF4 level without a binary search.
# A power of two makes (y + 1) * grid exact in fp32, and at 2048 every NF4 midpoint is > 0.04 of
# a cell away from a cell edge, so rounding of y + 1 (< 3e-4 of a cell) can never move a value
# across a midpoint: the result equals torch.bucketize (checked in the tests).
_NF4_GRID = 2048


@functools.cache
def bnb_functional():
    """bitsandbytes.functional, or None when bitsandbytes is not importable."""
    try:
        import bitsandbytes.functional as bnb_f
    except Exception as exc:  # any import-time failure means "no bnb here"
        logger.info("bitsandbytes unavailable, using torch kernels only: %s", exc)
        return None
    return bnb_f


def bnb_supports(block: int) -> bool:
    return block in BNB_BLOCK_SIZES and bnb_functional() is not None


_PROBE_ELEMENTS = 4096


@functools.cache
def bnb_works(device: torch.device, block: int) -> bool:
    """Whether bitsandbytes' kernels run on ``device`` and agree with the torch kernels: an int8 and an
    int4 round trip of one probe tensor, each decoded by both backends, asked once per device and block
    size. A bitsandbytes whose native library fails (the case ``learning/_optimizer.py`` probes for
    too) would otherwise fail every exchange."""
    try:
        x = torch.linspace(-1.0, 1.0, _PROBE_ELEMENTS, device=device)
        q, absmax = int8_encode(x, block, "bnb")
        packed, scales = int4_encode(x, block, "bnb")
        ours = [int8_decode(q, absmax, block, b) for b in ("bnb", "torch")]
        ours += [int4_decode(packed, scales, x.numel(), block, b) for b in ("bnb", "torch")]
        ok = all(bool(torch.allclose(t, x, atol=0.2)) for t in ours)  # int4's step at the block's edge
        ok = ok and bool(torch.allclose(ours[0], ours[1])) and bool(torch.allclose(ours[2], ours[3]))
    except Exception as error:  # any failure of the native library: do not use it
        logger.warning("bitsandbytes' quantization fails on %s (%s): using the torch codec", device, error)
        return False
    if not ok:
        logger.warning("bitsandbytes' quantization disagrees with torch's on %s: using torch's", device)
    return ok


def resolve_backend(backend: str, block: int, device: torch.device) -> Backend:
    """Pick the kernel: "auto" uses bitsandbytes on CUDA where its kernels work (:func:`bnb_works`) and
    torch elsewhere (faster on the CPU, measured)."""
    if backend == "torch":
        return "torch"
    if backend == "bnb":
        if not bnb_supports(block):
            raise ValueError(f"backend 'bnb' needs bitsandbytes and block_size in {sorted(BNB_BLOCK_SIZES)}")
        return "bnb"
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'bnb' or 'torch'")
    return "bnb" if device.type == "cuda" and bnb_supports(block) and bnb_works(device, block) else "torch"


def _row_chunks(rows: int, block: int, device: torch.device) -> int:
    return rows if device.type != "cpu" else max(1, _CPU_CHUNK // block)


def _blocks(x: torch.Tensor, block: int, chunked: bool = True) -> list[torch.Tensor]:
    """Views of `x` as [rows, block] pieces: full blocks (chunked on CPU) then the partial tail."""
    n = x.numel()
    full = n - n % block
    rows = full // block
    step = _row_chunks(rows, block, x.device) if chunked else max(rows, 1)
    views = [x[r * block : min(rows, r + step) * block].view(-1, block) for r in range(0, rows, step)]
    if full < n:
        views.append(x[full:].view(1, -1))
    return views


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block max |x| (fp32); NaN propagates so callers can reject non-finite input."""
    out = torch.empty(-(-x.numel() // block), dtype=torch.float32, device=x.device)
    i = 0
    for v in _blocks(x, block, chunked=False):
        out[i : i + v.shape[0]] = torch.maximum(v.amax(dim=1), v.amin(dim=1).neg())
        i += v.shape[0]
    return out


# ---------------------------------------------------------------------------------------- int8


def int8_encode(x: torch.Tensor, block: int, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 [n], absmax fp32 [blocks])."""
    if backend == "bnb":
        return _int8_encode_bnb(x, block)
    absmax = block_absmax(x, block).clamp_min_(TINY_SCALE)
    step = absmax / 127.0
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    tmp = None
    i = 0
    for v in _blocks(x, block):
        r = v.shape[0]
        if tmp is None or tmp.numel() < v.numel():
            tmp = torch.empty(v.numel(), dtype=torch.float32, device=x.device)
        y = torch.div(v, step[i : i + r, None], out=tmp[: v.numel()].view_as(v))
        y.round_()
        q[i * block : i * block + v.numel()].view_as(v).copy_(y)
        i += r
    return q, absmax


def int8_decode(
    q: torch.Tensor, absmax: torch.Tensor, block: int, backend: Backend, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of `int8_encode`: q * absmax / 127 as fp32, written into `out` when given."""
    if out is None:
        out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out
    if backend == "bnb":
        bnb_f = bnb_functional()
        code = _int8_twos_complement_code(q.device)
        res = bnb_f.dequantize_blockwise(
            q.view(torch.uint8), absmax=absmax.float(), code=code, blocksize=block
        )
        return out.copy_(res)
    step = absmax / 127.0
    i = 0
    for qv in _blocks(q, block):
        r = qv.shape[0]
        o = out[i * block : i * block + qv.numel()].view_as(qv)
        o.copy_(qv)
        o.mul_(step[i : i + r, None])
        i += r
    return out


@functools.cache
def _int8_sorted_code(device: torch.device) -> torch.Tensor:
    # index u <-> value (u - 128) / 127; sorted, as bitsandbytes' binary search requires.
    return ((torch.arange(256, dtype=torch.float32) - 128) / 127).to(device)


@functools.cache
def _int8_twos_complement_code(device: torch.device) -> torch.Tensor:
    # the int8 wire byte read as uint8 indexes its own value: decode needs no remapping pass
    u = torch.arange(256, dtype=torch.float32)
    return (torch.where(u < 128, u, u - 256) / 127).to(device)


def _int8_encode_bnb(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    bnb_f = bnb_functional()
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.int8, device=x.device), torch.empty(0, device=x.device)
    idx, state = bnb_f.quantize_blockwise(x, code=_int8_sorted_code(x.device), blocksize=block)
    q = torch.bitwise_xor(idx, 128).view(torch.int8)  # u - 128 in two's complement
    q.clamp_(min=-127)  # an all-zero block comes back as index 0; keep codes canonical
    return q, state.absmax.float().clamp_min_(TINY_SCALE)


# ---------------------------------------------------------------------------------------- int4


def bf16_round_up(a: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16 >= a (a >= 0, finite), as a bf16 tensor: x / scale then stays within [-1, 1]."""
    bits = a.float().contiguous().view(torch.int32)
    up = ((bits + 0xFFFF) >> 16).to(torch.int16)
    return up.view(torch.bfloat16)


@functools.cache
def _nf4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels, pair table [256, 2], per-cell count of midpoints below, per-cell midpoint or +inf)."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    mids = (levels[:-1] + levels[1:]) / 2
    cells = 2 * _NF4_GRID
    lows = torch.arange(cells, dtype=torch.float64) / _NF4_GRID - 1
    below = torch.searchsorted(mids.double(), lows, right=False).to(torch.uint8)
    padded = torch.cat([mids, torch.tensor([float("inf")])])
    thresh = padded[below.long()]
    byte = torch.arange(256)
    pairs = torch.stack([levels[byte >> 4], levels[byte & 15]], dim=1)
    return levels.to(device), pairs.to(device), below.to(device), thresh.to(device)


def int4_payload_len(n: int) -> int:
    return (n + 1) // 2


def int4_encode(x: torch.Tensor, block: int, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (packed uint8 [ceil(n/2)], scales bf16 [blocks])."""
    if backend == "bnb":
        return _int4_encode_bnb(x, block)
    scales = bf16_round_up(block_absmax(x, block).clamp_min_(TINY_SCALE))
    scale32 = scales.float()
    if scale32.numel() and not bool(torch.isfinite(scale32).all()):
        raise ValueError("int4: input has NaN/Inf")
    _, _, below, thresh = _nf4_tables(x.device)
    idx = torch.empty(x.numel() + x.numel() % 2, dtype=torch.uint8, device=x.device)
    idx[x.numel() :] = 0
    i = 0
    for v in _blocks(x, block):
        r, m = v.shape[0], v.numel()
        y = torch.div(v, scale32[i : i + r, None]).view(-1)
        cell = (y + 1).mul_(_NF4_GRID).floor_().clamp_(0, 2 * _NF4_GRID - 1).to(torch.int32)
        dst = idx[i * block : i * block + m]
        torch.index_select(below, 0, cell, out=dst)
        dst.add_(torch.index_select(thresh, 0, cell).lt_(y).to(torch.uint8))
        i += r
    return (idx[0::2] << 4) | idx[1::2], scales


def int4_decode(
    packed: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    block: int,
    backend: Backend,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of `int4_encode`: n fp32 values, written into `out` when given."""
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    if n == 0:
        return out
    scale32 = scales.float()
    if backend == "bnb" and n % 2 == 0:
        bnb_f = bnb_functional()
        state = bnb_f.QuantState(
            absmax=scale32, shape=torch.Size([n]), dtype=torch.float32, blocksize=block, quant_type="nf4"
        )
        return out.copy_(bnb_f.dequantize_4bit(packed.view(-1, 1), state).view(-1))
    _, pairs, _, _ = _nf4_tables(packed.device)
    step = _row_chunks(-(-n // block), block, packed.device) * block
    for s in range(0, n, step):
        e = min(n, s + step)
        vals = torch.index_select(pairs, 0, packed[s // 2 : (e + 1) // 2].to(torch.int32)).view(-1)[: e - s]
        o = out[s:e]
        o.copy_(vals)
        full = (e - s) - (e - s) % block
        if full:
            o[:full].view(-1, block).mul_(scale32[s // block : (s + full) // block, None])
        if full < e - s:
            o[full:].mul_(scale32[(s + full) // block])
    return out


def _int4_encode_bnb(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    bnb_f = bnb_functional()
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), torch.empty(
            0, dtype=torch.bfloat16, device=x.device
        )
    packed, state = bnb_f.quantize_4bit(x, blocksize=block, quant_type="nf4")
    # bitsandbytes scaled by the exact fp32 absmax; the wire carries it rounded to nearest bf16
    # (relative error <= 2**-8 on each block's scale, far below the NF4 step).
    scales = state.absmax.float().clamp_min_(TINY_SCALE).to(torch.bfloat16)
    packed = packed.view(-1)[: int4_payload_len(x.numel())].clone()
    if x.numel() % 2:
        packed[-1] &= 0xF0  # bitsandbytes pads with the code of 0.0; the wire wants a zero nibble
    return packed, scales
