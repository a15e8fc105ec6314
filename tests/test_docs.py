"""The docs agree with the repository: the README links every doc, its links resolve, and
docs/configuration.md lists the schema's sections and per-peer keys as the code has them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.bench_report_doc import BEGIN, END
from swarm.config import PER_PEER_KEYS, SECTIONS, RunConfig

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
REPORT_PARTS = ("bench_report_doc", "bench_report_targets")
"""The modules of scripts/ that write the benchmarks doc's generated block, and cite its sections."""
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NUMBERS = {
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
}


def _readme_links() -> list[str]:
    return LINK.findall((REPO / "README.md").read_text())


def test_the_readme_links_every_doc() -> None:
    linked = {(REPO / target.split("#", 1)[0]).resolve() for target in _readme_links()}
    missing = [doc.name for doc in sorted(DOCS.glob("*.md")) if doc.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_every_readme_link_resolves() -> None:
    local = [target for target in _readme_links() if not re.match(r"[a-z]+://", target)]
    assert local
    broken = [target for target in local if not (REPO / target.split("#", 1)[0]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


def _configuration() -> str:
    return (DOCS / "configuration.md").read_text()


def test_the_configuration_doc_lists_the_schemas_sections() -> None:
    assert list(SECTIONS) == list(RunConfig.model_fields)
    match = re.search(r"with (\w+) sections:\s*(.*?)\(`swarm\.config\.SECTIONS`\)", _configuration(), re.S)
    assert match, "docs/configuration.md no longer says 'with N sections: ... (`swarm.config.SECTIONS`)'"
    count, listed = match.group(1), re.findall(r"`(\w+)`", match.group(2))
    assert listed == list(SECTIONS)
    assert NUMBERS.get(count) == len(SECTIONS), f"it says {count} sections; the schema has {len(SECTIONS)}"
    headings = re.findall(r"^### `(\w+)`$", _configuration(), re.M)
    assert headings == list(SECTIONS)


def _rows(section: str) -> dict[str, str]:
    body = _configuration().split(f"### `{section}`", 1)[1].split("\n### ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \|(.*)$", body, re.M))


@pytest.mark.parametrize("section", SECTIONS)
def test_the_configuration_doc_marks_exactly_the_per_peer_keys(section: str) -> None:
    rows = _rows(section)
    assert set(rows) == set(RunConfig.model_fields[section].annotation.model_fields)  # type: ignore[union-attr]
    for key, row in rows.items():
        per_peer = section in PER_PEER_KEYS or f"{section}.{key}" in PER_PEER_KEYS
        assert ("**(per peer)**" in row) == per_peer, f"{section}.{key}: per peer is {per_peer}"


def test_the_benchmarks_doc_keeps_the_generated_block_and_the_sections_it_cites() -> None:
    text = (DOCS / "benchmarks.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)
    generator = "".join((REPO / "scripts" / f"{part}.py").read_text() for part in REPORT_PARTS)
    cited = set(re.findall(r'docs/benchmarks\.md, "([^"]+)"', generator))
    cited |= set(re.findall(r'see "([^"]+)" below', generator))
    assert cited
    headings = set(re.findall(r"^#+ (.+)$", text, re.M))
    assert not cited - headings, f"the report cites sections docs/benchmarks.md lacks: {cited - headings}"
