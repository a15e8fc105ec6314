"""Pipeline stages across peers, SWARM-style: models larger than one peer's device (docs/pipeline.md).

The model is cut into ``pipeline.num_stages`` contiguous stages (:func:`plan_stages`, the same on every
peer). A peer serves one stage (:class:`StagePeer`, the trainer's core with :class:`OneStage`): stage 0
peers hold the data and the embeddings and route each micro-batch through one live peer per later stage,
chosen at random by measured throughput and queue (:class:`Router`); the others answer FORWARD and
BACKWARD requests on a P2P stream (:class:`StageServer`). Peers of one stage keep it in agreement with
the gossip trainer's machinery, namespaced by stage, and move to an under-served stage when the
imbalance persists (:class:`Rebalancer`).

Names are exported lazily (PEP 562): the config hash of ``num_stages: auto`` needs only the planner, and
``import swarm.pipeline`` loads neither torch nor hivemind.
"""

from __future__ import annotations

from typing import Any

from swarm._lazy import load_export

_EXPORTS = {
    "PartSizes": "swarm.pipeline._plan",
    "StageSpec": "swarm.pipeline._plan",
    "check_pipeline": "swarm.pipeline._plan",
    "part_sizes": "swarm.pipeline._plan",
    "plan_stages": "swarm.pipeline._estimate",
    "resolve_num_stages": "swarm.pipeline._estimate",
    "cut_stages": "swarm.pipeline._plan",
    "split_blocks": "swarm.pipeline._plan",
    "StageModule": "swarm.pipeline._stages",
    "build_full": "swarm.pipeline._stages",
    "build_stage": "swarm.pipeline._stages",
    "stage_parameters": "swarm.pipeline._stages",
    "StageEstimate": "swarm.pipeline._estimate",
    "activation_wire_bytes": "swarm.pipeline._estimate",
    "describe_stages": "swarm.pipeline._estimate",
    "estimate_stage": "swarm.pipeline._estimate",
    "ServerLimits": "swarm.pipeline._protocol",
    "StageError": "swarm.pipeline._protocol",
    "StageServer": "swarm.pipeline._server",
    "StageWorker": "swarm.pipeline._compute",
    "StageClient": "swarm.pipeline._client",
    "Router": "swarm.pipeline._router",
    "StageLoad": "swarm.pipeline._balance",
    "Rebalancer": "swarm.pipeline._balance",
    "choose_stage": "swarm.pipeline._balance",
    "stage_loads": "swarm.pipeline._balance",
    "OneStage": "swarm.pipeline._peer",
    "StagePeer": "swarm.pipeline._peer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name, globals())
