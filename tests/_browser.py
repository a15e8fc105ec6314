"""Headless Chromium for the status-page tests: load a page, dump its DOM or take a screenshot.

Chromium comes from the OS packages (scripts/test_tools.sh installs it as root, as CI runs). Without
it the tests skip only where it cannot be installed (not root); as root a missing browser fails them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests._processes import REPO, kill_all, session_processes

ARTIFACTS = REPO / "test-artifacts"
"""Where browser tests keep their screenshots (git-ignored)."""


def chromium_or_skip() -> str:
    """The chromium binary; skips (not root: cannot install it) or fails (root: it should be there)."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() == 0:
        pytest.fail("chromium is missing; scripts/test_tools.sh installs it (scripts/test.sh runs it first)")
    pytest.skip("chromium is not installed and installing it needs root: sudo apt-get install chromium")


def load(url: str, profile: Path, *args: str, budget_ms: int = 8000, timeout: float = 90) -> str:
    """Run headless chromium on ``url`` with ``args`` (e.g. ``--dump-dom``); return its stdout.

    ``budget_ms`` of virtual time lets the page's timers (its polling) run before the dump or the
    screenshot. The browser runs in a session of its own; whatever of it is left afterwards is killed.
    """
    command = [
        chromium_or_skip(),
        "--headless",
        "--no-sandbox",  # as root (CI) chromium refuses to start with its sandbox
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *args,
        url,
    ]
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"chromium did not finish within {timeout}s:\n{err[-3000:]}") from None
    finally:
        kill_all(session_processes({process.pid}))
    assert process.returncode == 0, f"chromium exited {process.returncode}:\n{err[-3000:]}"
    return out


class Dom(HTMLParser):
    """What the tests read from a dumped DOM: attributes by element id, the text of table rows."""

    def __init__(self, html: str):
        super().__init__()
        self.by_id: dict[str, dict[str, str]] = {}
        self.rows: dict[str, list[list[str]]] = {}  # table id -> rows of cell texts (tbody only)
        self.row_attrs: dict[str, list[dict[str, str]]] = {}
        self.tags: list[str] = []
        self._table: str | None = None
        self._in_body = False
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        self.tags.append(tag)
        if "id" in values:
            self.by_id[values["id"]] = values
        if tag == "table":
            self._table = values.get("id", "")
            self.rows[self._table], self.row_attrs[self._table] = [], []
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body and self._table is not None:
            self.rows[self._table].append([])
            self.row_attrs[self._table].append(values)
        elif tag == "td" and self._in_body and self._table is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._table is not None:
            self.rows[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "tbody":
            self._in_body = False
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
