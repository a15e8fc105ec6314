"""scripts/bench_join.py, its quick run on the emulated internet (needs root and network namespaces).

What must hold whatever the machine's load (no timing is asserted): the joiner gets the donors'
state, every frame of it exactly once, from both donors when both stay; and when the second donor is
killed half-way, the first donor completes the download sending only what had not arrived.
"""

from __future__ import annotations

import pytest

from scripts import bench_join
from testbed.netlab import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


def test_the_quick_join_bench_takes_every_frame_once_and_survives_a_donor_leaving() -> None:
    numbers = bench_join.bench(bench_join.QUICK_MBYTES, "20mbit")
    both, leaves = numbers["both"], numbers["one_leaves"]
    for run in (both, leaves):
        assert run["state_bytes"] >= bench_join.QUICK_MBYTES * 1e6
        assert run["received_bytes"] == run["state_bytes"]  # no frame came twice
        assert run["ratio"] > 0
    assert sorted(both["complete_parts_from"]) == [0, 1] and both["killed_after_bytes"] is None
    assert 0 < leaves["killed_after_bytes"] < leaves["state_bytes"]
    assert leaves["complete_parts_from"] == [0]  # donor 1 never finished its part: donor 0 did
