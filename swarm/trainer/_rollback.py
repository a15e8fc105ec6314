"""roll_back: put a trainer's parameters back after they went non-finite (whole model or one stage).

Back to the last round's parameters (the backend's anchor), with a fresh inner optimizer state,
counted in the record; the swarm's state if the anchor is not finite either. Non-finite tensors are
never served (see LiveModel) nor saved.
"""

from __future__ import annotations

import logging

import torch

from swarm.learning import all_finite
from swarm.trainer._backend import AveragingBackend, JoinResult
from swarm.trainer._progress import Progress

logger = logging.getLogger(__name__)


def roll_back(
    what: str,
    progress: Progress,
    backend: AveragingBackend,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> JoinResult | None:
    """Roll ``module`` back after non-finite ``what``; clear ``optimizer``'s state (AdamW's moments
    may hold NaN as well; None: the backend owns the optimizer). Returns the join result when the
    swarm's state had to be taken; raises RuntimeError when no finite state could be had."""
    progress.rollbacks += 1
    logger.warning(
        "non-finite %s at step %d: rolling back to the last round's parameters (rollback %d)",
        what,
        progress.step,
        progress.rollbacks,
    )
    if optimizer is not None:
        optimizer.state.clear()
    if backend.rollback():
        return None
    logger.warning("the last round's parameters are not finite either: taking the swarm's state")
    joined = backend.join(fresh=True)
    if not all_finite(p.detach() for p in module.parameters()):
        raise RuntimeError("training diverged and no finite state could be fetched from the swarm")
    return joined
