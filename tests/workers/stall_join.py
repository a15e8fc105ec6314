"""``swarm join`` whose gossip exchanges stall when *it* initiates: for the shutdown tests.

Runs the real CLI (``python -m tests.workers.stall_join join ...``) with one test-only change: every
averager's channel is wrapped (``wrap_channel``) so that an exchange this peer initiated stalls after
its first DATA frame (a stalling channel, tests/_faults.py; its training thread then waits inside
``sync``), never one it serves, nor the anchor exchange a joiner adopts a partner's state through.
When it stalls it prints ``STALLED`` on stdout, so a test can signal it mid-exchange.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from swarm.gossip import GossipAverager
from tests._faults import StallingChannel

_INITIATING = contextvars.ContextVar("initiating", default=False)
_real_init, _real_initiate = GossipAverager.__init__, GossipAverager._initiate


def _announce_stall() -> None:
    print("STALLED", flush=True)


def _stall_if_initiating(channel: Any) -> Any:
    """Called as each exchange's data phase begins, in the task of the exchange."""
    return StallingChannel(channel, 1, _announce_stall) if _INITIATING.get() else channel


@functools.wraps(_real_init)
def _init(self, *args, **kwargs) -> None:
    if not str(kwargs.get("run_id", "")).endswith(".params"):  # a joiner's adoption is start-up, not a
        kwargs["wrap_channel"] = _stall_if_initiating  # round: a stop there ends the start-up instead
    _real_init(self, *args, **kwargs)


@functools.wraps(_real_initiate)
async def _initiate(self, *args, **kwargs):
    _INITIATING.set(True)  # task-local: the serving side runs in other tasks
    return await _real_initiate(self, *args, **kwargs)


def main() -> None:
    GossipAverager.__init__ = _init
    GossipAverager._initiate = _initiate
    from peers.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
