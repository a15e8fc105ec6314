"""The command line every benchmark shares: its module docstring as help, ``--quick`` and ``--json``."""

from __future__ import annotations

import argparse


def bench_parser(doc: str | None, quick: str) -> argparse.ArgumentParser:
    """A parser with ``doc`` as its description (kept as written), ``--quick`` (``quick`` says what
    it shortens) and ``--json`` (one JSON object on the last line)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return parser
