"""Whether one peer of a run fits a machine, in which layout, and what to change if it does not.

``swarm config check FILE --device-memory 12GiB --host-memory 16GiB`` asks this of
:func:`fit_peer`. The layouts are the trainer's own choices
(:func:`swarm.learning.estimate.outer_state_on_host`): the outer state (anchor, momentum, residuals,
exchange buffers) on the device, or in host memory, with the config's activation checkpointing.
``averaging.outer_state_device: auto`` takes the device layout when its footprint needs at most
:data:`DEVICE_HEADROOM` of the device, else the host layout; ``device`` and ``host`` take theirs.
A layout fits when its footprint (the tensors, the allocator's slack and the CUDA context:
:meth:`~swarm.learning.estimate.PeerEstimate.device_footprint`) fits the device and its host memory
(the program, the page-locked batches, the state there, and a joiner's peak) fits the host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from swarm.config import RunConfig
from swarm.learning.estimate import PeerEstimate, format_bytes

DEVICE_HEADROOM = 0.9
"""The share of a device's memory that ``auto`` lets the device layout's footprint take (the trainer's
threshold): the rest is left to what the estimate does not see (other processes, a display)."""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_memory_size(text: str) -> int:
    """Bytes of a size such as ``12GiB``, ``16GB``, ``800MiB``, ``12G`` or ``1048576``: binary units
    (``GB`` counts as ``GiB``, as memory is sold), whole bytes. Raises ValueError naming the input."""
    match = _SIZE.match(text)
    if match is None or ("i" in match.group(3).lower() and not match.group(2)):
        raise ValueError(f"not a memory size: {text!r} (write e.g. 12GiB, 16GB, 800MiB)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 0 < value < 1 << 60:
        raise ValueError(f"memory size out of range: {text!r}")
    return int(value)


@dataclass(frozen=True)
class Layout:
    """Where the outer state lives, and what the peer then needs on the device and in host memory."""

    host_state: bool
    device_bytes: int
    host_bytes: int

    @property
    def name(self) -> str:
        return "outer state in host memory" if self.host_state else "outer state on the device"


@dataclass(frozen=True)
class Fit:
    """The verdict: whether the layout the trainer would take fits, that layout, and advice."""

    fits: bool
    layout: Layout
    advice: list[str]


def layouts(estimate: PeerEstimate, checkpointing: bool, cpu: bool) -> list[Layout]:
    """The peer's layouts: on a CPU peer the device is the host, so there is one."""
    if cpu:
        return [Layout(False, 0, estimate.memory(checkpointing))]
    return [
        Layout(
            host,
            estimate.device_footprint(checkpointing, host_state=host),
            estimate.host_memory(host_state=host),
        )
        for host in (False, True)
    ]


def fit_peer(
    config: RunConfig, estimate: PeerEstimate, device_bytes: int | None, host_bytes: int | None
) -> Fit:
    """Whether one peer of ``config`` fits ``device_bytes`` of device and ``host_bytes`` of host
    memory (None: not limited), in the layout the trainer would choose (module docstring)."""
    cpu = estimate.device == "cpu"
    checkpointing = config.train.activation_checkpointing
    options = layouts(estimate, checkpointing, cpu)
    layout = _chosen(options, config.averaging.outer_state_device, device_bytes)
    fits = _fits(layout, device_bytes, host_bytes)
    advice = [] if fits else _advice(config, estimate, layout, device_bytes, host_bytes)
    return Fit(fits, layout, advice)


def _chosen(options: list[Layout], choice: str, device_bytes: int | None) -> Layout:
    if len(options) == 1 or choice == "device":
        return options[0]
    if choice == "host":
        return options[1]
    on_device = options[0]
    return (
        on_device
        if device_bytes is None or on_device.device_bytes <= DEVICE_HEADROOM * device_bytes
        else options[1]
    )


def _fits(layout: Layout, device_bytes: int | None, host_bytes: int | None) -> bool:
    device_ok = device_bytes is None or layout.device_bytes <= device_bytes
    return device_ok and (host_bytes is None or layout.host_bytes <= host_bytes)


def _advice(
    config: RunConfig,
    estimate: PeerEstimate,
    layout: Layout,
    device_bytes: int | None,
    host_bytes: int | None,
) -> list[str]:
    """What to change, most specific first: a setting that makes it fit, else what is missing."""
    cpu, checkpointing = estimate.device == "cpu", config.train.activation_checkpointing
    advice = []
    if not checkpointing and any(_fits(o, device_bytes, host_bytes) for o in layouts(estimate, True, cpu)):
        advice.append("set train.activation_checkpointing: true (it then fits)")
    choice = config.averaging.outer_state_device
    if (
        not cpu
        and choice != "auto"
        and any(_fits(o, device_bytes, host_bytes) for o in layouts(estimate, checkpointing, cpu))
    ):
        advice.append(f"set averaging.outer_state_device: auto (not {choice}): the other layout fits")
    split = _split_advice(config)
    if device_bytes is not None and layout.device_bytes > device_bytes:
        smallest = min(o.device_bytes for o in layouts(estimate, True, cpu))
        advice.append(
            f"the device must hold {format_bytes(layout.device_bytes)} in this layout (context and "
            f"allocator slack included), {format_bytes(device_bytes)} given; the smallest layout needs "
            f"{format_bytes(smallest)}: {split}"
        )
    if host_bytes is not None and layout.host_bytes > host_bytes:
        outer = f"the outer state {format_bytes(estimate.outer)}, " if layout.host_state else ""
        advice.append(
            f"host memory: {format_bytes(layout.host_bytes)} needed, {format_bytes(host_bytes)} given "
            f"(the program {format_bytes(estimate.program)}, {outer}the shared bases "
            f"{format_bytes(estimate.bases)}, the partners' frames "
            f"{format_bytes(estimate.exchange_frames)} or a joiner's download "
            f"{format_bytes(estimate.joining)}): {split}"
        )
    return advice


def _split_advice(config: RunConfig) -> str:
    """What to do when no layout fits: pipeline stages, where the pipeline can split this model
    (``model.kind: gpt``; swarm/pipeline/_plan.py refuses ``hf``), else a smaller model or more memory."""
    if config.model.kind == "gpt":
        return "split the model over pipeline stages (docs/pipeline.md), or train a smaller one"
    return (
        f"train a smaller model or use a machine with more memory (model.kind: {config.model.kind} "
        "cannot be split over pipeline stages, which need model.kind: gpt)"
    )


def describe_fit(fit: Fit, device_bytes: int | None, host_bytes: int | None) -> list[str]:
    """Lines for ``swarm config check``: the verdict, the layout, and the advice."""
    limits = ", ".join(
        f"{what} {format_bytes(n) if n is not None else 'not limited'}"
        for what, n in (("device", device_bytes), ("host", host_bytes))
    )
    layout, verdict = fit.layout, "fits" if fit.fits else "does NOT fit"
    device, host = format_bytes(layout.device_bytes), format_bytes(layout.host_bytes)
    needs = f"{device} on the device, {host} of host memory"
    return [f"this peer {verdict} ({limits}): {layout.name}, {needs}", *(f"  - {a}" for a in fit.advice)]
