"""A trainer's state as donors serve it, and how a joiner takes it over.

Every trainer publishes, after each outer step, a snapshot of what a newcomer needs: the anchor
parameters, the outer momentum and its progress counters; the snapshot's digest goes into its
membership record (``state_hash``). A joiner takes the state a trusted initial peer announces, or the
coordinate-wise median of at least three distinct donors' states, and verifies every frame against
the announced digests (:func:`swarm.state.download_state`; see docs/state-sync.md).

Which members to download from (:func:`~swarm.state.choose_donors`) and the check of a donor's
progress counters (:func:`~swarm.state.progress_of`) live in :mod:`swarm.state` with the bootstrap's
copy of the state (:class:`~swarm.state.StateMirror`); they are re-exported here for the trainer.
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.compression import DecodeLimits
from swarm.learning import OuterOptimizer
from swarm.state import StateSnapshot, choose_donors, make_snapshot, progress_of
from swarm.trainer._progress import Progress

__all__ = ["adopt", "choose_donors", "progress_of", "snapshot_of", "state_limits"]

_PARAM, _MOMENTUM = "param/", "momentum/"


def snapshot_of(
    outer: OuterOptimizer, progress: Progress, joined: dict[str, int] | None = None
) -> StateSnapshot:
    """The state a joiner needs: anchor, outer momentum (once it exists) and progress counters.

    The counters are the state's: those of the state this peer took over at join (``joined``, the
    donors' meta) plus its own since. A freshly joined peer so serves the swarm's progress, not its
    own round 0 (a bootstrap keeping the state would otherwise go back to round 0 on copying it).
    """
    tensors = {_PARAM + name: t for name, t in outer.anchor.items()}
    tensors.update({_MOMENTUM + name: t for name, t in outer.momentum_buffers.items()})
    base = joined or {}
    meta: dict[str, Any] = {
        "round": base.get("round", 0) + progress.round,
        "step": base.get("step", 0) + progress.step,
        "samples_total": base.get("samples_total", 0) + progress.samples_total,
    }
    return make_snapshot(tensors, meta)


def state_limits(model: torch.nn.Module) -> DecodeLimits:
    """Decode limits for a state of ``model``: a donor cannot make us allocate more than the model
    (parameters plus outer momentum) would take."""
    sizes = [p.numel() for p in model.parameters()]
    return DecodeLimits(
        max_elements=max(sizes, default=1),
        max_tensors=2 * len(sizes) + 1,
        max_total_elements=2 * sum(sizes),
    )


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
