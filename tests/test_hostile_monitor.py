"""Finding 10 of issue 28: the monitor shows peer text as text.

A peer chooses its ``public_name``, ``device`` and ``package_version``; the monitor must neither read
them as rich markup (``[/oops]`` used to raise and end the monitor and its ``--http`` page) nor pass
control characters or terminal escape sequences through to the user's terminal.
"""

from __future__ import annotations

import io
import json
import urllib.request

import pytest
from rich.console import Console

from peers._monitor_output import TerminalOutput
from peers._monitor_table import render, shown
from swarm.metrics import build_snapshot
from tests.test_metrics import POLICY, T0, member

HOSTILE = {
    1: "[/oops]",
    2: "[bold red]x",
    3: "\x1b[2J\x1b]0;pwned\x07clear",
    4: "a\rb\x08c\x9bd",
    5: "left\u202eright",
}
RAW = ("\x1b[2J", "\x1b]0;", "\x07", "\r", "\x08", "\x9b", "\u202e")


def hostile_snapshot():
    members = [
        member(
            n,
            T0,
            public_name=name,
            device=f"gpu{name}",
            package_version=f"9{name}",
            config_hash=f"{n:02d}" * 8,
        )
        for n, name in HOSTILE.items()
    ]
    return build_snapshot(members, None, T0, POLICY)


def _assert_safe(out: str, live: bool = False) -> None:
    for raw in RAW:
        if live and raw == "\r":  # rich.live moves the cursor with it
            continue
        assert raw not in out, (raw, out)


@pytest.mark.parametrize("terminal", [True, False])
def test_table_shows_markup_as_text_and_escapes_control_characters(terminal: bool) -> None:
    console = Console(file=io.StringIO(), width=200, force_terminal=terminal, color_system="standard")
    console.print(render(hostile_snapshot(), console.width))
    out = console.file.getvalue()
    _assert_safe(out)
    assert "[/oops]" in out and "[bold red]x" in out
    assert "\\x1b[2J" in out and "\\x07clear" in out and "\\u202e" in out


def test_warning_lines_are_escaped() -> None:
    snapshot = hostile_snapshot()
    assert any("[bold red]x" in w.message for w in snapshot.warnings)
    console = Console(file=io.StringIO(), width=300, force_terminal=False)
    console.print(render(snapshot, console.width))
    out = console.file.getvalue()
    _assert_safe(out)
    assert "[bold red]x: config hash" in out and "\\x1b[2J\\x1b]0;pwned\\x07clear: config" in out


@pytest.mark.parametrize("live", [True, False])
def test_terminal_output_survives_hostile_names(live: bool) -> None:
    console = Console(file=io.StringIO(), force_terminal=live, width=120)
    output = TerminalOutput("table", live=live, console=console)
    output.show(hostile_snapshot())
    output.show(hostile_snapshot())
    output.close()
    out = console.file.getvalue()
    _assert_safe(out, live)
    assert "[/oops]" in out


def test_shown_escapes_only_what_a_terminal_would_act_on() -> None:
    assert shown("Zürich-Ω 東京 [x]") == "Zürich-Ω 東京 [x]"
    assert shown("\x1b\x00\x7f\x85\u2028\u200b") == "\\x1b\\x00\\x7f\\x85\\u2028\\u200b"


def test_monitor_sinks_and_status_page_keep_serving_hostile_names(capsys) -> None:
    from peers._monitor_http import StatusServer
    from peers.monitor import _Sinks

    sinks = _Sinks("table", once=False)
    server = StatusServer("127.0.0.1", 0, refresh_s=1.0)
    sinks.extras.append(server)
    try:
        sinks.emit(hostile_snapshot())
        sinks.emit(hostile_snapshot())
        with urllib.request.urlopen(f"{server.url}api/snapshot.json", timeout=10) as response:
            names = {p["public_name"] for p in json.load(response)["peers"]}
    finally:
        sinks.close()
    assert names == set(HOSTILE.values())
    out = capsys.readouterr().out
    _assert_safe(out)
    assert "[/oops]" in out


def test_plot_labels_are_text_never_matplotlib_mathematics() -> None:
    """A public name like ``$\\alpha$`` would be typeset (or, malformed, raise) as a legend label."""
    from peers._monitor_plot import series

    snapshot = {
        "time": 0.0,
        "peers": [{"public_name": "$\\alpha$\x1b[31m", "role": "trainer", "loss": 2.0}],
        "totals": {},
    }
    labels = list(series([snapshot], "loss", "loss"))
    assert "\\$\\alpha\\$\\x1b[31m" in labels, labels
