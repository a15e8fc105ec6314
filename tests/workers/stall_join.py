"""``swarm join`` whose gossip exchanges stall when *it* initiates: for the shutdown tests.

Runs the real CLI (``python -m tests.workers.stall_join join ...``) with one test-only change: every
averager gets ``ExchangeHooks(stall_after_frames=1)``, and the stall only takes effect in an exchange
this peer initiated (its training thread then waits inside ``sync``), never while serving a partner.
When it stalls it prints ``STALLED`` on stdout, so a test can signal it mid-exchange.
"""

from __future__ import annotations

import contextvars
import functools

from swarm.gossip import GossipAverager, _exchange
from swarm.gossip._exchange import ExchangeHooks

_INITIATING = contextvars.ContextVar("initiating", default=False)
_real_init, _real_initiate, _real_stall = GossipAverager.__init__, GossipAverager._initiate, _exchange._stall


def _announce_stall() -> None:
    print("STALLED", flush=True)


@functools.wraps(_real_init)
def _init(self, *args, **kwargs) -> None:
    kwargs["_hooks"] = ExchangeHooks(stall_after_frames=1, on_stall=_announce_stall)
    _real_init(self, *args, **kwargs)


@functools.wraps(_real_initiate)
async def _initiate(self, *args, **kwargs):
    _INITIATING.set(True)  # task-local: the serving side runs in other tasks
    return await _real_initiate(self, *args, **kwargs)


async def _stall_if_initiating(on_stall) -> None:
    if _INITIATING.get():
        await _real_stall(on_stall)


def main() -> None:
    GossipAverager.__init__ = _init
    GossipAverager._initiate = _initiate
    _exchange._stall = _stall_if_initiating
    from peers.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
