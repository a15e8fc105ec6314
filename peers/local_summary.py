"""The end-of-run summary of `swarm local`: one row per peer and one for the swarm, as a table and JSON."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

SUMMARY_KEYS = (
    "eval_loss",
    "eval_bits_per_byte",
    "tokens_per_second",
    "wire_bytes_per_param_per_sync",
    "exchange_bytes_per_param",
    "drift",
    "utilization",
)


def collect(summary_files: list[Path]) -> list[dict[str, Any]]:
    """The per-peer summaries that were written (a peer that crashed writes none)."""
    rows = []
    for path in summary_files:
        try:
            rows.append({"name": path.stem.removesuffix(".summary"), **json.loads(path.read_text())})
        except (OSError, ValueError):
            continue
    return rows


def swarm_summary(rows: list[dict[str, Any]], baseline_unigram_loss: float | None) -> dict[str, Any]:
    """Swarm-level numbers: mean eval loss and drift, total throughput, mean wire bytes.

    ``eval_loss`` and the unigram baseline are in ``eval_loss_unit`` (bits per token, per byte for
    byte-level data); ``eval_bits_per_byte`` is the eval loss per byte of text whatever the tokenizer.
    """

    def mean(key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    return {
        "peers": len(rows),
        "eval_loss": mean("eval_loss"),
        "eval_loss_unit": rows[0].get("eval_loss_unit", "bits/byte") if rows else "bits/byte",
        "eval_bits_per_byte": mean("eval_bits_per_byte"),
        "baseline_unigram_loss": baseline_unigram_loss,
        "tokens_per_second": sum(r.get("tokens_per_second") or 0.0 for r in rows),
        "wire_bytes_per_param_per_sync": mean("wire_bytes_per_param_per_sync"),
        "exchange_bytes_per_param": mean("exchange_bytes_per_param"),
        "drift": mean("drift"),
        "utilization": mean("utilization"),
        "per_peer": rows,
    }


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """A rich table with one row per peer and a bold swarm row."""
    console = console or Console()
    table = Table(title=f"swarm local: {summary['peers']} peers")
    unit = summary["eval_loss_unit"]
    for column in ("peer", "steps", f"eval ({unit})", "tokens/s", "wire B/param/sync", "drift", "util"):
        table.add_column(column, justify="right")
    for row in summary["per_peer"]:
        table.add_row(row["name"], str(row.get("steps", "-")), *_cells(row))
    table.add_row("[b]swarm[/b]", "", *_cells(summary))
    console.print(table)
    if summary["eval_loss"] is None:
        return
    line = f"eval loss {summary['eval_loss']:.3f} {unit}"
    if unit != "bits/byte" and summary.get("eval_bits_per_byte") is not None:
        line += f" ({summary['eval_bits_per_byte']:.3f} bits/byte)"
    if summary["baseline_unigram_loss"] is not None:
        line += f" vs unigram baseline {summary['baseline_unigram_loss']:.3f} {unit}"
    console.print(line)


def _cells(row: dict[str, Any]) -> list[str]:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return [
        fmt(row.get("eval_loss"), ".3f"),
        fmt(row.get("tokens_per_second"), ".0f"),
        fmt(row.get("wire_bytes_per_param_per_sync"), ".3f"),
        fmt(row.get("drift"), ".4f"),
        fmt(row.get("utilization"), ".0%"),
    ]
