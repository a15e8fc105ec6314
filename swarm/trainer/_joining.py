"""A trainer's state as donors serve it, and how a joiner takes it over.

Every trainer publishes, after each outer step, a snapshot of what a newcomer needs: the anchor
parameters, the outer momentum and its progress counters; the snapshot's digest goes into its
membership record (``state_hash``). A joiner downloads from several donors at once and verifies every
frame against the announced digests (:func:`swarm.state.download_state`; see docs/state-sync.md).
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.state import StateSnapshot, make_snapshot
from swarm.trainer._progress import Progress
from swarm.training import OuterOptimizer

_PARAM, _MOMENTUM = "param/", "momentum/"


def snapshot_of(outer: OuterOptimizer, progress: Progress) -> StateSnapshot:
    """The state a joiner needs: anchor, outer momentum (once it exists) and progress counters."""
    tensors = {_PARAM + name: t for name, t in outer.anchor.items()}
    tensors.update({_MOMENTUM + name: t for name, t in outer.momentum_buffers.items()})
    meta: dict[str, Any] = {
        "round": progress.round,
        "step": progress.step,
        "samples_total": progress.samples_total,
    }
    return make_snapshot(tensors, meta)


@torch.no_grad()
def adopt(model: torch.nn.Module, outer: OuterOptimizer, snapshot: StateSnapshot) -> None:
    """Load a downloaded snapshot: parameters into the model and anchor, momentum into the outer optimizer."""
    params = dict(model.named_parameters())
    received = {name[len(_PARAM) :] for name in snapshot.tensors if name.startswith(_PARAM)}
    if received != set(params):
        missing, extra = sorted(set(params) - received), sorted(received - set(params))
        raise ValueError(f"donor state does not match this model: missing {missing[:3]}, extra {extra[:3]}")
    for name, param in params.items():
        param.copy_(snapshot.tensors[_PARAM + name])
    outer.reset_anchor()
    outer.momentum_buffers = {
        name[len(_MOMENTUM) :]: t.to(outer.anchor[name[len(_MOMENTUM) :]].device, copy=True)
        for name, t in snapshot.tensors.items()
        if name.startswith(_MOMENTUM) and name[len(_MOMENTUM) :] in params
    }
