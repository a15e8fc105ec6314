"""Take the live swarm's model over the verified state download, as a joining peer would."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from swarm.compression import DecodeLimits
from swarm.config import RunConfig
from swarm.export._files import ExportedModel, ExportError, progress_counters, run_tokenizer
from swarm.learning import build_model
from swarm.state import StateTransferError, choose_donors, download_state, initial_peer_ids, progress_of

if TYPE_CHECKING:
    from swarm import SwarmNode

_PARAM = "param/"


def download_model(
    node: SwarmNode,
    config: RunConfig,
    *,
    wait_s: float = 30.0,
    timeout_s: float = 60.0,
    stop: threading.Event | None = None,
) -> ExportedModel:
    """The model of the state that the run's live trainers (or a ``--serve-state`` bootstrap) announce.

    ``node`` is an open, non-announcing :class:`~swarm.SwarmNode` of the run; donors are the members
    of ``config``'s hash that announce a state, waited for up to ``wait_s``. The state is downloaded
    and verified by :func:`swarm.state.download_state` (an initial peer's state, or the median of
    three or more donors'); its anchor ``param/<name>`` tensors are the parameters. Raises
    :class:`ExportError`.
    """
    if config.pipeline.num_stages != 1:
        raise ExportError("a pipelined run's state is per stage: export from a checkpoint instead")
    stop = stop or threading.Event()
    deadline = time.monotonic() + wait_s
    trusted = initial_peer_ids(node.network.initial_peers)  # their state, or the median of 3 donors'
    while True:
        members = [m for m in node.members() if m.record.config_hash == config.config_hash()]
        donors = choose_donors(members, node.peer_id, trusted=trusted)
        if donors or time.monotonic() >= deadline or stop.wait(0.5):
            break
    if not donors:
        raise ExportError(
            f"no peer of run {config.run.run_id!r} with config hash {config.config_hash()} announces a "
            "state: no trainer is live, and no bootstrap holds one (a --serve-state bootstrap keeps one "
            "once it has the median of 3 trainers' states; its 'state mirror' status lines say why it "
            "has none, and --state-min-donors lowers that)"
        )
    model = build_model(config.model, config.run.seed)
    params = dict(model.named_parameters())
    sizes = [p.numel() for p in params.values()]
    limits = DecodeLimits(  # parameters plus outer momentum, no more
        max_elements=max(sizes), max_tensors=2 * len(sizes) + 1, max_total_elements=2 * sum(sizes)
    )
    try:
        snapshot = download_state(
            node.dht, donors, run_id=config.run.run_id, trusted=trusted, limits=limits, timeout_s=timeout_s
        )
        progress = progress_of(snapshot.meta)
    except StateTransferError as error:
        raise ExportError(f"state download failed: {error}") from error
    received = {name[len(_PARAM) :]: t for name, t in snapshot.tensors.items() if name.startswith(_PARAM)}
    if set(received) != set(params):
        missing, extra = sorted(set(params) - set(received)), sorted(set(received) - set(params))
        raise ExportError(
            f"the swarm's state does not fit this model: missing {missing[:3]}, extra {extra[:3]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            if received[name].shape != param.shape:
                raise ExportError(
                    f"the swarm's {name} has shape {tuple(received[name].shape)}, not {tuple(param.shape)}"
                )
            param.copy_(received[name])
    return ExportedModel(
        model.eval(),
        config.model,
        config.run.run_id,
        config.config_hash(),
        progress_counters(progress),
        run_tokenizer(config),
    )
