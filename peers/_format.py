"""Numbers as the monitor writes them, in the terminal table and on the status page alike: anything
that is not a finite number (a peer's record is untrusted) shows as ``-``."""

from __future__ import annotations

import math


def known(value: object) -> bool:
    """Whether ``value`` is a finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def si(value: object, unit: str = "") -> str:
    """1.5k, 2.0M ... as the page script writes them; ``-`` for no number."""
    if not known(value):
        return "-"
    number = float(value)  # type: ignore[arg-type]
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= factor:
            return f"{number / factor:.1f}{prefix}{unit}"
    return (str(int(number)) if number.is_integer() else f"{number:.1f}") + unit


def duration(seconds: object) -> str:
    """12s, 3m05s, 2h10m, 1d03h; a negative one (a clock ahead of ours) is 0s."""
    if not known(seconds):
        return "-"
    s = max(0, round(float(seconds)))  # type: ignore[arg-type]
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s // 60) % 60:02d}m"
    return f"{s // 86400}d{(s // 3600) % 24:02d}h"
