"""The status page's numbers rendered on the server, so that the page reads without its script.

:func:`fill_page` puts the latest snapshot (its JSON form, ``SwarmSnapshot.to_dict``) into the page
template: the run id and state, the totals cards, the peer and stage tables and the warnings. The
page's script, when it runs, redraws the same elements from ``/api/snapshot.json`` on every refresh;
these functions format the numbers as it does. Every text from a record is escaped: peers choose it.
"""

from __future__ import annotations

import re
import time
from html import escape
from typing import Any

from peers._format import duration, known, si

_PLACEHOLDER = re.compile(r"__(?:RUN_ID|STATUS|TOTALS|PEERS|STAGES|WARNINGS)__")
NO_SNAPSHOT = "no snapshot yet: the monitor is still looking for the swarm's records"


def fill_page(template: str, snapshot: dict[str, Any] | None) -> str:
    """The page with the snapshot's numbers in it (or a line saying there is none yet)."""
    if snapshot is None:
        parts = {"__RUN_ID__": "?", "__STATUS__": escape(NO_SNAPSHOT)}
    else:
        totals = snapshot.get("totals") or {}
        parts = {
            "__RUN_ID__": escape(str(snapshot.get("run_id", "?"))),
            "__STATUS__": escape(_status(snapshot, totals)),
            "__TOTALS__": "".join(_card(label, value) for label, value in total_cards(totals)),
            "__PEERS__": "".join(_peer_row(p) for p in snapshot.get("peers") or []),
            "__STAGES__": "".join(_stage_row(s) for s in snapshot.get("stages") or []),
            "__WARNINGS__": "".join(
                f"<li>{escape(str(w.get('kind')))}: {escape(str(w.get('message')))}</li>"
                for w in snapshot.get("warnings") or []
            ),
        }
    parts.setdefault("__TOTALS__", "")
    parts.setdefault("__PEERS__", "")
    parts.setdefault("__STAGES__", "")
    if not parts.get("__WARNINGS__"):
        parts["__WARNINGS__"] = '<li class="none">none</li>'
    # one pass: a value (a peer's name, say) that reads like a placeholder stays text
    return _PLACEHOLDER.sub(lambda match: parts.get(match.group(0), match.group(0)), template)


def _status(snapshot: dict[str, Any], totals: dict[str, Any]) -> str:
    when = snapshot.get("time")
    at = time.strftime("%H:%M:%S", time.localtime(when)) if known(when) else "?"
    return f"{run_state_words(totals)} · updated {at}"


def run_state_words(totals: dict[str, Any]) -> str:
    """``training``, ``waiting for trainers``, or ``finished`` (and why): never an empty swarm."""
    state = totals.get("run_state")
    if state == "finished":
        reached = known(totals.get("progress")) and totals["progress"] >= 1.0
        return "finished: target reached" if reached else "finished: no trainer live"
    if state == "training":
        return "training"
    return "waiting for trainers"


def total_cards(t: dict[str, Any]) -> list[tuple[str, str]]:
    """The totals cards, label and text, in the page script's order."""
    unit = f", {t['loss_unit']}" if t.get("loss_unit") else ""
    progress = t.get("progress")
    return [
        ("run", run_state_words(t)),
        ("peers", _plain(t.get("peers"))),
        ("trainers", _plain(t.get("trainers"))),
        ("stale", _plain(t.get("stale"))),
        ("incompatible", _plain(t.get("incompatible"))),
        (f"eval loss (mean{unit})", fixed(t.get("eval_loss_mean"), 4)),
        (f"train loss (mean{unit})", fixed(t.get("loss_mean"), 4)),
        ("train loss (best)", fixed(t.get("loss_best"), 4)),
        ("samples/s", si(t.get("samples_per_s"))),
        ("samples trained", si(t.get("samples_total"))),
        ("upload", si(t.get("upload_bps"), "B/s")),
        ("download", si(t.get("download_bps"), "B/s")),
        ("syncs/min", fixed(t.get("syncs_per_min"), 1)),
        ("progress", f"{100 * float(progress):.1f}%" if known(progress) else "-"),  # type: ignore[arg-type]
        ("ETA", duration(t.get("eta_s"))),
    ]


def _card(label: str, value: str) -> str:
    label_html = f'<div class="label">{escape(label)}</div>'
    return f'<div class="card">{label_html}<div class="value">{escape(value)}</div></div>'


def _peer_row(p: dict[str, Any]) -> str:
    state = str(p.get("state", ""))
    state_class = "state-" + "".join(c for c in state if "a" <= c <= "z")
    cells = [
        ("text id", p.get("short_id")),
        ("text name", p.get("public_name")),
        ("text", p.get("role")),
        (f"text {state_class}", state),
        ("stage-col", p.get("stage")),
        ("", si(p.get("samples_per_s"))),
        ("", fixed(p.get("loss"), 4)),
        ("", fixed(p.get("eval_loss"), 4)),
        ("", f"{p.get('round')}/{p.get('step')}"),
        ("", si(p.get("upload_bps"), "B/s")),
        ("", si(p.get("download_bps"), "B/s")),
        ("", si(p.get("bytes_sent"), "B")),
        ("", si(p.get("bytes_received"), "B")),
        ("", fixed(p.get("drift"), 3)),
        ("", duration(p.get("last_seen_ago_s"))),
    ]
    return "<tr>" + "".join(_cell(css, value) for css, value in cells) + "</tr>"


def _stage_row(s: dict[str, Any]) -> str:
    css = ' class="bottleneck"' if s.get("bottleneck") else ""
    cells = [s.get("stage"), s.get("peers"), si(s.get("samples_per_s")), si(s.get("capacity"))]
    tail = _cell("text", "bottleneck" if s.get("bottleneck") else "")
    return f"<tr{css}>" + "".join(_cell("", c) for c in cells) + tail + "</tr>"


def _cell(css: str, value: object) -> str:
    text = escape("" if value is None else str(value))
    return f'<td class="{css}">{text}</td>' if css else f"<td>{text}</td>"


def _plain(value: object) -> str:
    return str(value) if known(value) else "-"


def fixed(value: object, digits: int) -> str:
    return f"{float(value):.{digits}f}" if known(value) else "-"  # type: ignore[arg-type]
