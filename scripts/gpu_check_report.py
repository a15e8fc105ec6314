"""The verdict of scripts/gpu_check.sh: its steps' figures and every condition, as JSON and a table.

    python -m scripts.gpu_check_report --work DIR --out OUT.json --tests-rc N --memory-rc N \\
        --swarm-rc N [--swarms NAME ...] [--dry-run] [--install TEXT]

``DIR`` holds the steps' files: ``tests.log``, ``llama-host.json`` and ``llama-device.json``
(scripts/_gpu_steps.py), ``gpt-bf16.json`` and ``gpt-fp16.json`` (`swarm local --summary`) of the swarm
runs ``--swarms`` names. Each condition is ``pass``, ``FAIL``, or ``n/a`` where it needs CUDA and the run
has none (the dry run, which also runs one swarm only). Exits 1 when a step did not run or a condition
failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

PEAK_RANGE = (0.8, 1.15)
"""Where a measured peak (allocated) may lie, as a share of the estimate."""
CAP_BYTES = 12 * 2**30
SWARMS = ("gpt-bf16", "gpt-fp16")
FIGURES = (
    "tokens_per_second",
    "mfu",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "estimated_device_bytes",
    "footprint_bytes",
    "host_rss_bytes",
    "pinned_bytes",
)


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _condition(name: str, ok: bool | None, detail: str) -> dict[str, Any]:
    return {"condition": name, "status": "n/a" if ok is None else "pass" if ok else "FAIL", "detail": detail}


def memory_conditions(step: dict[str, Any]) -> list[dict[str, Any]]:
    """Per llama step: 8-bit AdamW, the peak against the estimate, the capped run's footprint."""
    cuda, name = step["cuda"], step["step"]
    ratio, eight_bit = step["peak_over_estimate"], step["optimizer"] == "adamw8bit"
    peak = f"peak {step['peak_allocated_bytes']} B over estimate {step['estimated_device_bytes']} B"
    out = [
        _condition(f"{name}: 8-bit AdamW", eight_bit if cuda else None, step["optimizer"]),
        _condition(
            f"{name}: peak within {PEAK_RANGE[0]}-{PEAK_RANGE[1]} of the estimate",
            PEAK_RANGE[0] <= ratio <= PEAK_RANGE[1] if cuda and ratio is not None else None,
            f"{peak}: {ratio}",
        ),
        _condition(
            f"{name}: the round committed", bool(step["exchange"]["committed"]), str(step["exchange"])
        ),
    ]
    if step.get("cap_bytes") or (not cuda and "host" in name):
        footprint = step["footprint_bytes"]
        out.append(
            _condition(
                f"{name}: footprint within the 12 GiB cap",
                footprint <= CAP_BYTES if cuda and footprint is not None else None,
                f"footprint {footprint} B (reserved + context)",
            )
        )
    return out


def swarm_conditions(name: str, summary: dict[str, Any] | None, cuda: bool) -> list[dict[str, Any]]:
    """Per 2-peer run: both peers committed an exchange and (on CUDA) used 8-bit AdamW."""
    peers = summary["per_peer"] if summary else []
    exchanges = [p.get("exchanges_ok", 0) for p in peers]
    optimizers = [p.get("optimizer") for p in peers]
    return [
        _condition(
            f"{name}: every peer committed an exchange",
            len(peers) == 2 and min(exchanges) > 0,
            str(exchanges),
        ),
        _condition(
            f"{name}: 8-bit AdamW",
            all(o == "adamw8bit" for o in optimizers) if cuda else None,
            str(optimizers),
        ),
    ]


def tests_condition(work: Path, rc: int, dry: bool) -> dict[str, Any]:
    log = (work / "tests.log").read_text() if (work / "tests.log").exists() else ""
    last = log.strip().splitlines()[-1] if log.strip() else ""
    if dry:
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", log)
        return _condition("the CUDA tests exist", rc == 0 and collected is not None, last)
    skipped = re.search(r"(\d+) skipped", last)
    return _condition("every CUDA test passed, none skipped", rc == 0 and skipped is None, last)


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    work = args.work
    steps = {name: _load(work / f"{name}.json") for name in ("llama-host", "llama-device")}
    swarms = {name: _load(work / f"{name}.json") for name in SWARMS if name in args.swarms}
    cuda = any(s and s["cuda"] for s in steps.values())
    conditions = [tests_condition(work, args.tests_rc, args.dry_run)]
    for name, step in steps.items():
        if step is None:
            conditions.append(_condition(f"{name}: ran", False, f"no {name}.json (see {name}.log)"))
        else:
            conditions += memory_conditions(step)
    for name in SWARMS:
        if name in swarms:
            conditions += swarm_conditions(name, swarms[name], cuda)
        else:  # the real check runs both
            conditions.append(_condition(f"{name}: ran", None if args.dry_run else False, "not run"))
    exit_codes = {"tests": args.tests_rc, "memory": args.memory_rc, "swarm": args.swarm_rc}
    conditions.append(_condition("every step exited 0", not any(exit_codes.values()), str(exit_codes)))
    return {
        "dry_run": args.dry_run,
        "install": args.install,
        "steps": steps,
        "swarms": {name: (s or {}).get("per_peer") for name, s in swarms.items()},
        "conditions": conditions,
        "ok": all(c["status"] != "FAIL" for c in conditions),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests-rc", type=int, required=True)
    parser.add_argument("--memory-rc", type=int, required=True)
    parser.add_argument("--swarm-rc", type=int, required=True)
    parser.add_argument("--swarms", nargs="*", choices=SWARMS, default=list(SWARMS))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--install", default="")
    args = parser.parse_args(argv)
    report = build_report(args)
    args.out.write_text(json.dumps(report, indent=2))
    for step in report["steps"].values():
        if step:
            keys = FIGURES
            print(f"gpu_check: {step['step']}: " + ", ".join(f"{k} {step[k]}" for k in keys))
    for c in report["conditions"]:
        print(f"gpu_check: [{c['status']:>4}] {c['condition']}: {c['detail']}")
    print(f"gpu_check: wrote {args.out}; {'OK' if report['ok'] else 'FAILED'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
