"""Helpers of scripts/gpu_prepare.sh and scripts/gpu_check.sh for the wheel folder (gpu-wheels/).

    python -m scripts._gpu_wheels strip-bitsandbytes DIR --cuda 130   # keep one CUDA library
    python -m scripts._gpu_wheels bnb-cuda DIR                        # which CUDA the kept one is for

bitsandbytes' wheel ships a native library per CUDA release (``libbitsandbytes_cuda118.so`` ...
``libbitsandbytes_cuda130.so``) and one for the CPU; the check needs the CPU one and the one of the
image's torch. The wheel is rewritten without the others (its RECORD too, so that pip accepts it).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

_CUDA_LIBRARY = re.compile(r"libbitsandbytes_cuda(\d+)\w*\.(so|dll|dylib)$")


def kept(name: str, cuda: str) -> bool:
    """Whether a file of the wheel stays: everything but the CUDA libraries of other versions."""
    match = _CUDA_LIBRARY.search(name)
    return match is None or match.group(1) == cuda


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def strip_wheel(wheel: Path, cuda: str) -> tuple[int, int, list[str]]:
    """Rewrite ``wheel`` keeping only the CUDA library of ``cuda``; returns (bytes before, after, the
    CUDA libraries kept)."""
    before = wheel.stat().st_size
    stripped = wheel.with_suffix(".tmp")
    kept_cuda: list[str] = []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as out:
        names = [n for n in source.namelist() if kept(n, cuda)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = []
        for name in names:
            if name == record:
                continue
            data = source.read(name)
            out.writestr(source.getinfo(name), data)
            lines.append(_record_line(name, data))
            if _CUDA_LIBRARY.search(name):
                kept_cuda.append(Path(name).name)
        out.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    stripped.replace(wheel)
    return before, wheel.stat().st_size, kept_cuda


def bnb_cuda(folder: Path) -> list[str]:
    """The CUDA versions whose bitsandbytes library the folder's wheel holds."""
    found = []
    for wheel in folder.glob("bitsandbytes-*.whl"):
        with zipfile.ZipFile(wheel) as source:
            found += [m.group(1) for n in source.namelist() if (m := _CUDA_LIBRARY.search(n))]
    return sorted(set(found))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("strip-bitsandbytes", "bnb-cuda"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--cuda", default="130")
    args = parser.parse_args(argv)
    if args.command == "bnb-cuda":
        print(" ".join(bnb_cuda(args.folder)))
        return 0
    wheels = list(args.folder.glob("bitsandbytes-*.whl"))
    if not wheels:
        print(
            "gpu_prepare: no bitsandbytes wheel: the check will report 8-bit AdamW missing", file=sys.stderr
        )
        return 0
    for wheel in wheels:
        before, after, libraries = strip_wheel(wheel, args.cuda)
        print(f"gpu_prepare: {wheel.name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB, kept {libraries}")
        if not libraries:
            print(f"gpu_prepare: {wheel.name} has no library for CUDA {args.cuda}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
