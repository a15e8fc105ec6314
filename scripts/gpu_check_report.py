"""The JSON of scripts/gpu_check.sh: per peer of its 2-peer swarm, tokens/s, MFU, peak memory against
the estimate at the micro-batch the peer chose, and the precision and optimizer it chose.

    python scripts/gpu_check_report.py --work DIR --out OUT.json --tests-rc N --swarm-rc N --steps N \\
        -- --set key=value ...

``DIR/summary.json`` is `swarm local --summary`'s file (absent when the swarm failed: no peers then).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from swarm.config import RunConfig, load_config
from swarm.learning import build_model
from swarm.learning.estimate import activation_bytes, estimate_peer, model_shape

CONFIG = "configs/gpt-125m.yaml"


def estimated_device_bytes(config: RunConfig, optimizer: str | None, micro_batch: int) -> int:
    """The estimate's device memory (outer state on the device) at ``micro_batch`` samples per forward:
    the estimate is for one, and activations grow in proportion."""
    with torch.device("meta"):
        shape = model_shape(config, build_model(config.model, 0))
    checkpointing = config.train.activation_checkpointing
    per_sample = activation_bytes(shape, 1)[1 if checkpointing else 0]
    estimate = estimate_peer(config, "cuda", eight_bit=optimizer == "adamw8bit")
    return estimate.device_memory(checkpointing) + (micro_batch - 1) * per_sample


def peer_row(config: RunConfig, peer: dict[str, Any]) -> dict[str, Any]:
    micro = int(peer.get("micro_batch_size") or 1)
    expected = estimated_device_bytes(config, peer.get("optimizer"), micro)
    peak = peer.get("peak_memory_bytes")
    keys = ("peer_id", "steps", "rounds", "exchanges_ok", "precision", "optimizer", "oom_retries")
    return {
        **{key: peer.get(key) for key in keys},
        "micro_batch_size": micro,
        "tokens_per_second": peer.get("tokens_per_second"),
        "compute_tokens_per_second": peer.get("compute_tokens_per_second"),
        "mfu": peer.get("mfu"),
        "peak_memory_bytes": peak,
        "estimated_device_bytes": expected,
        "peak_over_estimate": None if peak is None else peak / expected,
    }


def device_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": None}
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "device_memory_bytes": props.total_memory, "torch": torch.__version__}


def build_report(
    work: Path, overrides: list[str], tests_rc: int, tests_result: str, swarm_rc: int, steps: int
) -> dict[str, Any]:
    config = load_config(CONFIG, overrides, env={})
    summary = work / "summary.json"
    peers = json.loads(summary.read_text())["per_peer"] if summary.exists() else []
    return {
        **device_info(),
        "cuda_tests": {"exit_code": tests_rc, "result": tests_result},
        "swarm": {
            "exit_code": swarm_rc,
            "peers": 2,
            "steps": steps,
            "config": CONFIG,
            "overrides": overrides,
        },
        "per_peer": [peer_row(config, peer) for peer in peers],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests-rc", type=int, required=True)
    parser.add_argument("--tests-result", default="")
    parser.add_argument("--swarm-rc", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("sets", nargs="*", help="the swarm's --set KEY=VALUE pairs")
    args = parser.parse_args(argv)
    overrides = [
        value for flag, value in zip(args.sets[::2], args.sets[1::2], strict=False) if flag == "--set"
    ]
    report = build_report(args.work, overrides, args.tests_rc, args.tests_result, args.swarm_rc, args.steps)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = args.tests_rc == 0 and args.swarm_rc == 0 and len(report["per_peer"]) == 2
    print(f"gpu_check: wrote {args.out}; {'OK' if ok else 'FAILED (see the exit codes above and the logs)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
