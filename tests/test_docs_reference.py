"""The docs read as a reference: the membership record's field list in docs/architecture.md is the
schema's, no doc but the benchmarks report carries dated run stories, and docs/gossip.md stays short.

Each check parses the docs with a small helper; the helpers are also run on broken text here, so that a
check that silently parses nothing cannot pass."""

from __future__ import annotations

import re
from pathlib import Path

from swarm.membership import PeerRecord

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
REPORT = DOCS / "benchmarks.md"
"""The one doc where measurements keep their dates: each says when and on what it ran."""
GOSSIP_MAX_LINES = 400
FIELDS_HEADING = "Fields (`swarm/membership/_record.py`"
DATE = re.compile(r"\b(?:19|20)\d{2}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
PARENTHESES = re.compile(r"\([^()]*\)")
IDENTIFIER = re.compile(r"`([a-z_][a-z0-9_]*)`")


def record_fields_in(text: str) -> list[str]:
    """The field names the doc lists: the backticked identifiers of the list that follows the
    ``Fields (...):`` line, up to the first blank line, with parenthesized remarks left out."""
    start = text.index(FIELDS_HEADING)
    body = text[text.index("\n", start) :].lstrip("\n")
    block = body.split("\n\n", 1)[0].replace("\n", " ")
    while PARENTHESES.search(block):
        block = PARENTHESES.sub("", block)
    return IDENTIFIER.findall(block)


def dated_lines(text: str) -> list[str]:
    """The lines that carry a calendar date (YYYY-MM-DD)."""
    return [line for line in text.splitlines() if DATE.search(line)]


def _docs_but_the_report() -> list[Path]:
    return [REPO / "README.md", *(doc for doc in sorted(DOCS.glob("*.md")) if doc != REPORT)]


def test_the_architecture_doc_lists_exactly_the_record_schemas_fields() -> None:
    listed = record_fields_in((DOCS / "architecture.md").read_text())
    schema = list(PeerRecord.__fields__)
    twice = sorted({field for field in listed if listed.count(field) > 1})
    assert not twice, f"docs/architecture.md lists these fields twice: {twice}"
    missing, extra = sorted(set(schema) - set(listed)), sorted(set(listed) - set(schema))
    assert not missing, f"PeerRecord fields docs/architecture.md does not list: {missing}"
    assert not extra, f"docs/architecture.md lists fields PeerRecord does not have: {extra}"


def test_the_field_list_parser_sees_a_missing_or_an_invented_field() -> None:
    doc = f"{FIELDS_HEADING}):\n\n- `peer_id`, `role` (`bootstrap` / `trainer`);\n- `stage`.\n\nMore."
    assert record_fields_in(doc) == ["peer_id", "role", "stage"]
    assert "stage_capacity" not in record_fields_in(doc)


def test_no_doc_but_the_benchmarks_report_carries_a_date() -> None:
    dated = {
        doc.relative_to(REPO).as_posix(): lines
        for doc in _docs_but_the_report()
        if (lines := dated_lines(doc.read_text()))
    }
    assert not dated, f"dated run stories belong in docs/benchmarks.md: {dated}"


def test_the_date_check_sees_a_dated_run_story() -> None:
    assert dated_lines("in two of three full-suite runs on 2026-12-02 it failed\nfine") == [
        "in two of three full-suite runs on 2026-12-02 it failed"
    ]
    assert not dated_lines("protocol 7, 2**21 values, 10-20 syncs, 0.23-1.06 apart, ckpt-000000000600.pt")


def test_the_gossip_doc_stays_a_short_reference() -> None:
    lines = len((DOCS / "gossip.md").read_text().splitlines())
    assert lines <= GOSSIP_MAX_LINES, f"docs/gossip.md has {lines} lines, at most {GOSSIP_MAX_LINES}"
