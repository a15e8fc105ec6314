"""Benchmark swarm's codecs against hivemind's on the same input, in the same run.

For each codec: bytes per parameter on the wire, encode / decode throughput (GB/s of fp32 input)
and relative L2 error. Ours are measured end to end: tensor -> frames (headers, scales, crc
included) -> TensorStreamDecoder -> tensor. hivemind's: compress -> SerializeToString and
ParseFromString -> extract, bytes = ByteSize() of the runtime_pb2.Tensor.

    .venv/bin/python -m scripts.bench_codecs            # 10M values
    .venv/bin/python -m scripts.bench_codecs --quick    # 2M values, fewer repeats (< 60 s)
    .venv/bin/python -m scripts.bench_codecs --json     # last line: {"rows": [...], ...}
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from scripts._cli import bench_parser
from swarm.compression import CODEC_NAMES, TensorStreamDecoder, encode_tensors, get_codec

HIVEMIND_BASELINE = "hivemind.BlockwiseQuantization"


def best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> tuple[float, object]:
    result = fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best, result


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float().to(ref.device) - ref).norm() / ref.norm())


def bench_ours(x: torch.Tensor, name: str, backend: str, repeats: int, sync) -> dict:
    codec = get_codec(name, 64, backend=backend)

    def encode() -> list[bytes]:
        return list(encode_tensors([("x", x)], codec, chunk_bytes=1 << 20))

    def decode(frames: list[bytes]) -> torch.Tensor:
        decoder = TensorStreamDecoder()
        for frame in frames:
            decoder.feed(frame)
        return decoder.finish()["x"]

    t_enc, frames = best_time(encode, repeats, sync)
    t_dec, out = best_time(lambda: decode(frames), repeats, sync)
    return row(
        f"{name}" + ("" if backend == "auto" else f" ({backend})"),
        x,
        sum(map(len, frames)),
        t_enc,
        t_dec,
        out,
    )


def bench_hivemind(x: torch.Tensor, repeats: int, sync) -> list[dict]:
    from hivemind.compression import (
        BlockwiseQuantization,
        CompressionInfo,
        Float16Compression,
        Uniform8BitQuantization,
    )
    from hivemind.proto import runtime_pb2

    x_cpu = x.cpu()  # hivemind's codecs work on CPU tensors (they go through numpy)
    rows = []
    for cls in (Float16Compression, Uniform8BitQuantization, BlockwiseQuantization):
        comp = cls()
        info = CompressionInfo.from_tensor(x_cpu)

        def encode(comp=comp, info=info) -> bytes:
            return comp.compress(x_cpu, info).SerializeToString()

        def decode(blob: bytes, comp=comp) -> torch.Tensor:
            msg = runtime_pb2.Tensor()
            msg.ParseFromString(blob)
            return comp.extract(msg)

        t_enc, blob = best_time(encode, repeats, sync)
        t_dec, out = best_time(lambda blob=blob, decode=decode: decode(blob), repeats, sync)
        msg = runtime_pb2.Tensor()
        msg.ParseFromString(blob)
        rows.append(row(f"hivemind.{cls.__name__}", x, msg.ByteSize(), t_enc, t_dec, out))
    return rows


def row(name: str, x: torch.Tensor, nbytes: int, t_enc: float, t_dec: float, out: torch.Tensor) -> dict:
    gb = x.numel() * 4 / 1e9
    return {
        "codec": name,
        "input": f"{str(x.dtype).removeprefix('torch.')}@{x.device.type}",
        "bytes_per_param": nbytes / x.numel(),
        "encode_gbps": gb / t_enc,
        "decode_gbps": gb / t_dec,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "rel_error": rel_error(out, x),
    }


def main() -> None:
    parser = bench_parser(__doc__, "2M values, 2 repeats: under a minute on 2 cores")
    parser.add_argument("--n", type=int, default=None, help="number of values (default 10M, 2M with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.n or (2_000_000 if args.quick else 10_000_000)
    repeats = 2 if args.quick else 3
    console = Console(stderr=args.json, width=150)
    if args.quick:
        console.print(f"[yellow]--quick: {n:,} values, best of {repeats} repeats (full run: 10M, best of 3)")

    torch.manual_seed(0)
    x = torch.randn(n)
    rows = []
    cpu_sync = lambda: None  # noqa: E731
    for name in CODEC_NAMES:
        rows.append(bench_ours(x, name, "auto", repeats, cpu_sync))
    for name in ("int8", "int4"):
        rows.append(bench_ours(x, name, "bnb", repeats, cpu_sync))
    try:
        rows += bench_hivemind(x, repeats, cpu_sync)
    except ImportError as exc:
        console.print(f"[yellow]hivemind not importable ({exc}): baselines and ratios skipped")
    device = "cpu"
    if torch.cuda.is_available():
        device = f"cpu+cuda ({torch.cuda.get_device_name()})"
        gpu_sync = torch.cuda.synchronize
        for dtype in (torch.float32, torch.bfloat16):
            xg = x.to("cuda", dtype)
            for name in CODEC_NAMES:
                rows.append(bench_ours(xg, name, "auto", repeats, gpu_sync))
            rows.append(bench_ours(xg, "int8", "torch", repeats, gpu_sync))

    base = next((r for r in rows if r["codec"] == HIVEMIND_BASELINE), None)
    for r in rows:
        if base is not None and not r["codec"].startswith("hivemind."):
            base_time = base["encode_s"] + base["decode_s"]
            r["speed_ratio_vs_hivemind_blockwise"] = base_time / (r["encode_s"] + r["decode_s"])
            r["error_ratio_vs_hivemind_blockwise"] = r["rel_error"] / base["rel_error"]

    threads = torch.get_num_threads()
    title = f"codecs on {n:,} N(0,1) values ({device}, {threads} threads, torch {torch.__version__})"
    table = Table(title=title)
    for col in (
        "codec",
        "input",
        "bytes/param",
        "encode GB/s",
        "decode GB/s",
        "rel L2 error",
        "speed vs hm-bw",
    ):
        table.add_column(col, justify="left" if col in ("codec", "input") else "right", no_wrap=True)
    for r in rows:
        ratio = r.get("speed_ratio_vs_hivemind_blockwise")
        table.add_row(
            r["codec"],
            r["input"],
            f"{r['bytes_per_param']:.4f}",
            f"{r['encode_gbps']:.2f}",
            f"{r['decode_gbps']:.2f}",
            f"{r['rel_error']:.2e}",
            "" if ratio is None else f"{ratio:.2f}x",
        )
    console.print(table)
    console.print("speed vs hm-bw = (hivemind BlockwiseQuantization encode+decode time) / (ours)")
    if args.json:
        summary = {
            "rows": rows,
            "device": device,
            "n": n,
            "quick": args.quick,
            "threads": torch.get_num_threads(),
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
