"""The words of ``swarm config check``: an estimate (:mod:`swarm.learning.estimate`) as the lines it
prints, both layouts, the breakdown of every term, and the wire per round."""

from __future__ import annotations

from swarm.learning.estimate import ALLOCATOR_SLACK, PeerEstimate, format_bytes


def describe_estimate(estimate: PeerEstimate, checkpointing: bool = False) -> list[str]:
    """Lines for ``swarm config check``: both layouts, the breakdown, and the wire per round."""
    e, b = estimate, format_bytes
    on_device = (e.device_memory(False), e.device_memory(True))
    split = (e.device_memory(False, host_state=True), e.device_memory(True, host_state=True))
    used = " (this config)" if checkpointing else ""
    return [
        f"parameters: {e.parameters:,}",
        f"memory per peer on {e.device} (micro-batch 1), outer state on the device: {b(on_device[0])}, "
        f"{b(on_device[1])} with activation checkpointing{used}",
        f"  with the outer state in host memory: {b(split[0])} on the device, {b(split[1])} with "
        f"activation checkpointing, plus {b(e.host_memory(host_state=True))} of host memory",
        f"  model: weights {b(e.weights)} + {e.precision} autocast copies {b(e.autocast_weights)}"
        f" ({b(e.autocast_weights_checkpointed)} checkpointed)"
        f" + {e.optimizer} {b(e.inner_optimizer)} + gradients {b(e.gradients)}"
        f" + accumulation {b(e.accumulation)} + activations {b(e.activations)}"
        f" ({b(e.activations_checkpointed)} checkpointed); evaluation peak {b(e.evaluation)}"
        f" in place of gradients and activations",
        f"  outer state: anchor and momentum {b(e.outer_state)} + error feedback {b(e.residuals)}"
        f" + exchange buffers {b(e.exchange_buffers)}; host memory for the partners' frames"
        f" {b(e.exchange_frames)} (the state served to joiners is on disk: 2 bytes per parameter of"
        f" anchor and momentum each)",
        f"  device beyond the tensors: allocator slack {ALLOCATOR_SLACK:.0%}"
        f" + context {b(e.device_context)}; the card must hold {b(e.device_footprint(checkpointing))}"
        f" ({b(e.device_footprint(checkpointing, host_state=True))} with the outer state in host memory)",
        f"  host: program {b(e.program)} + pinned {b(e.pinned)} (the prefetched batches; the outer"
        f" state is pageable) + shared bases {b(e.bases)} + the larger of the frames (with the outer"
        f" state where it is there) and a joiner's download {b(e.joining)} (+ its anchor"
        f" {b(e.joining_on_host)} with the outer state in host memory)",
        f"wire per sync per peer, each direction: {b(e.wire_per_sync)} ({_exchange_wire(e)})",
    ]


def _exchange_wire(e: PeerEstimate) -> str:
    change = f"{format_bytes(e.wire_change)} per round, initiated or served, after its last step"
    base = f"the base {format_bytes(e.wire_delta)} while it trains, about every other round"
    return f"the model's change from the pair's base {change}; {base}"
