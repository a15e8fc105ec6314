"""Terminal rendering of a :class:`~swarm.metrics.SwarmSnapshot` (rich): header, peer table, warnings.

Columns are chosen by priority so that the table fits the terminal: a 60-column terminal still shows
who is there, their state, throughput, loss and when they were last seen.

Every string a peer chose (its name, device, version, and the warnings that quote them) is shown as
text: cells are :class:`~rich.text.Text`, never markup, and :func:`shown` escapes the characters a
terminal would act on.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from peers._format import duration, si
from swarm.metrics import PeerView, StageView, SwarmSnapshot, SwarmTotals

STATE_STYLES = {
    "training": "green",
    "syncing": "cyan",
    "joining": "blue",
    "stale": "yellow",
    "incompatible": "red",
}


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    cell: Callable[[PeerView, float], str]
    justify: JustifyMethod = "left"


# Unicode categories a terminal acts on or that hide text: controls (C0, DEL, C1: escape sequences,
# carriage return, bell), format characters (bidi overrides, zero-width) and line/paragraph separators.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def shown(text: str) -> str:
    """``text`` safe to print on a terminal: each control or format character becomes its ``\\xNN`` /
    ``\\uNNNN`` escape, everything else (including ``[markup]``) stays as it is."""
    if text.isprintable():
        return text
    return "".join(_escape(c) if unicodedata.category(c) in _ESCAPED_CATEGORIES else c for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


# In priority order: the first columns survive the narrowest terminal.
COLUMNS = (
    Column("peer", 8, lambda p, now: p.short_id),
    Column("state", 12, lambda p, now: p.state),
    Column("name", 12, lambda p, now: p.public_name or "-"),
    Column("samples/s", 9, lambda p, now: si(p.samples_per_s), "right"),
    Column("loss", 7, lambda p, now: _loss(p.loss), "right"),
    Column("seen", 6, lambda p, now: duration(now - p.last_seen), "right"),
    Column("round/step", 10, lambda p, now: f"{p.round}/{p.step}", "right"),
    Column("up", 9, lambda p, now: si(p.upload_bps, "B/s"), "right"),
    Column("down", 9, lambda p, now: si(p.download_bps, "B/s"), "right"),
    Column("role", 9, lambda p, now: p.role),
    Column("conn", 6, lambda p, now: p.connectivity),
    Column("stage", 5, lambda p, now: str(p.stage), "right"),
    Column("version", 7, lambda p, now: p.package_version or "-"),
    Column("device", 14, lambda p, now: p.device or "-"),
)


def columns_for(width: int, snapshot: SwarmSnapshot | None = None) -> list[Column]:
    """The leading columns of :data:`COLUMNS` that fit ``width`` (measured on ``snapshot``'s cells)."""
    chosen: list[Column] = []
    used = 0
    for column in COLUMNS:
        used += _measure(column, snapshot) + 3
        if used > width + 1 and len(chosen) >= 3:
            break
        chosen.append(column)
    return chosen


def _measure(column: Column, snapshot: SwarmSnapshot | None) -> int:
    if snapshot is None or not snapshot.peers:
        return column.width
    cells = (len(_cell(column, p, snapshot.time)) for p in snapshot.peers)
    return max(len(column.title), *cells)


def _cell(column: Column, peer: PeerView, now: float) -> str:
    return shown(column.cell(peer, now))


def render(snapshot: SwarmSnapshot, width: int) -> RenderableType:
    """Header with swarm totals, the peer table, then one line per warning."""
    parts: list[RenderableType] = [*header_lines(snapshot), peer_table(snapshot, width)]
    parts.extend(Text(shown(f"! {w.kind}: {w.message}"), style="yellow") for w in snapshot.warnings)
    return Group(*parts)


def header_lines(snapshot: SwarmSnapshot) -> list[Text]:
    t = snapshot.totals
    lines = [
        Text(
            shown(f"run {snapshot.run_id or '?'} ")
            + f"{run_state_text(t)}: {t.peers} peers, {t.trainers} active trainers, "
            + f"{t.stale} stale, {t.incompatible} incompatible",
            style="bold",
        ),
        Text(
            f"{si(t.samples_per_s)} samples/s, {si(t.samples_total)} samples trained, {_losses(t)}, "
            f"{'-' if t.syncs_per_min is None else f'{t.syncs_per_min:.1f}'} syncs/min, "
            f"up {si(t.upload_bps, 'B/s')} down {si(t.download_bps, 'B/s')}"
        ),
    ]
    if t.target_samples:
        lines.append(
            Text(
                f"progress {100 * (t.progress or 0):.1f}% of {si(t.target_samples)} samples, "
                f"ETA {duration(t.eta_s)}"
            )
        )
    lines.extend(_stage_line(stage) for stage in snapshot.stages)
    return lines


def run_state_text(t: SwarmTotals) -> str:
    """The run's state in words: a finished run says so, instead of reading as an empty swarm."""
    if t.run_state == "finished":
        return "finished (no trainer live)" if t.trainers == 0 else "finished (target reached)"
    return t.run_state


def _losses(t: SwarmTotals) -> str:
    """'loss mean 4.21 best 4.1 eval 4.33 bits/byte': every loss of the snapshot is in one unit; a
    tokenized run (bits/token) adds its held-out loss per byte, which compares across tokenizers."""
    text = f"loss mean {_loss(t.loss_mean)} best {_loss(t.loss_best)}"
    text += f" eval {_loss(t.eval_loss_mean)} {t.loss_unit}"
    if t.loss_unit != "bits/byte" and t.eval_bits_per_byte_mean is not None:
        text += f" ({_loss(t.eval_bits_per_byte_mean)} bits/byte)"
    return text


def _stage_line(stage: StageView) -> Text:
    mark = "  <- bottleneck" if stage.bottleneck else ""
    return Text(
        f"stage {stage.stage}: {stage.peers} peers, {si(stage.samples_per_s)} samples/s, "
        f"capacity {si(stage.capacity)} samples/s{mark}",
        style="bold yellow" if stage.bottleneck else "",
    )


def peer_table(snapshot: SwarmSnapshot, width: int) -> Table:
    chosen = columns_for(width, snapshot)
    table = Table(expand=False, pad_edge=False, show_edge=False)
    for column in chosen:
        table.add_column(column.title, justify=column.justify, overflow="ellipsis", no_wrap=True)
    for peer in snapshot.peers:
        cells = [Text(_cell(column, peer, snapshot.time)) for column in chosen]
        table.add_row(*cells, style=STATE_STYLES.get(peer.state))
    return table
