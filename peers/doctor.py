"""`swarm doctor`: the preflight a volunteer runs before `swarm join`, with the same flags.

It says which versions are installed (and whether each dependency is within the project's pins),
whether this machine can be dialled back (with ``--initial-peers``: the join's own dial-back check,
from a short-lived peer that announces itself as a non-training ``averager`` for a few seconds), what
one peer of the run needs on each local device and the micro-batch it would take there (the estimate of
`swarm config check`), and whether the disk holds the checkpoints and the state spool. Every problem
comes with numbered advice; the exit status is 0 without problems, 1 with some, 2 on bad input.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from peers import _common as common

if TYPE_CHECKING:
    from packaging.requirements import Requirement

    from swarm.config import RunConfig
    from swarm.learning.estimate import PeerEstimate
    from swarm.network import NetworkOptions

PACKAGES = ("torch", "hivemind", "bitsandbytes", "swarm")
CHECKPOINTS_KEPT = 3
"""Checkpoints a peer keeps (``swarm.state.save_checkpoint``'s ``keep``); one more while it writes."""
SPOOLED_STATES = 2
"""States a peer may hold spooled at once: the one it serves and the next, while it is written."""
SPOOL_BYTES_PER_PARAMETER = 4
"""A spooled state: anchor and momentum in bf16 (docs/state-sync.md)."""
DISK_MARGIN = 1 << 30
"""Free disk to leave besides what the run writes (1 GiB)."""


@dataclass
class Problem:
    """One thing that stops or hurts this peer, and what to do about it, most useful first."""

    what: str
    advice: list[str] = field(default_factory=list)


@dataclass
class Report:
    """What the doctor found: the lines to print and the problems to number at the end."""

    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)

    def problem(self, what: str, *advice: str) -> None:
        self.problems.append(Problem(what, list(advice)))


@common.with_network_options
def doctor(
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    network_flags: common.NetworkFlags = common.NetworkFlags(),  # the network options (peers/_common.py)
) -> None:
    """Check this machine before joining: versions, dial-back, memory per device, free disk.

    Pass the flags you will pass to `swarm join` (--initial-peers, --port, --public-ip, --config, --set):
    without --initial-peers the dial-back is not checked and the config is --config or the defaults.
    Exit 0: no problem found; 1: problems, each with numbered advice; 2: bad input.
    """
    from peers.config_cmd import load_peer_config

    cfg, network = load_peer_config(config, set_ or (), network_flags)
    report = Report()
    where = str(config) if config else "the swarm's" if network.initial_peers else "the defaults"
    report.say(f"swarm doctor: run {cfg.run.run_id!r}, config {where} (hash {cfg.config_hash()})")
    check_versions(report)
    check_devices(report, cfg)
    check_disk(report, cfg)
    check_reachability(report, cfg, network, network_flags.public_name)
    for line in [*report.lines, *describe_problems(report.problems)]:
        typer.echo(line)
    raise typer.Exit(1 if report.problems else 0)


def describe_problems(problems: list[Problem]) -> list[str]:
    """The closing lines: "no problems found", or each problem numbered with its advice numbered."""
    if not problems:
        return ["OK: no problems found; join with the same flags: swarm join ..."]
    lines = [f"{len(problems)} problem(s):"]
    for number, problem in enumerate(problems, start=1):
        lines.append(f"{number}. {problem.what}")
        lines += [f"   {step}) {advice}" for step, advice in enumerate(problem.advice, start=1)]
    return lines


# ---------------------------------------------------------------- versions


def check_versions(report: Report) -> None:
    """Python and the main packages' versions; a dependency missing or outside its pin is a problem."""
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    found = {name: _version(name) for name in PACKAGES}
    found["torch"] = f"{found['torch']} ({build})"
    listed = ", ".join(f"{name} {version or 'not installed'}" for name, version in found.items())
    report.say(f"versions: python {platform.python_version()}, {listed}")
    for requirement, installed in unmet_requirements():
        report.problem(
            f"{requirement.name} {installed or 'is not installed'}: this swarm needs {requirement}",
            f"run scripts/setup.sh (or: pip install '{requirement}') in this checkout's .venv",
            "use the swarm version the organizer names; peers of other versions may not talk",
        )


def unmet_requirements() -> list[tuple[Requirement, str | None]]:
    """``(requirement, installed version or None)`` of each install requirement of swarm not met."""
    from packaging.requirements import Requirement

    unmet: list[tuple[Requirement, str | None]] = []
    for text in importlib.metadata.requires("swarm") or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement (hf, dev, ...)
        installed = _version(requirement.name)
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            unmet.append((requirement, installed))
    return unmet


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- devices


def check_devices(report: Report, config: RunConfig) -> None:
    """For the CPU and each CUDA device: what one peer needs there, the micro-batch it would take, and
    whether it fits (``swarm config check``'s estimate, :mod:`swarm.learning.fit`'s verdict)."""
    import psutil
    import torch

    host_free = int(psutil.virtual_memory().available)
    chosen = config.train.device
    cuda = torch.cuda.is_available()
    devices = [f"cuda:{index}" for index in range(torch.cuda.device_count())] if cuda else []
    if chosen == "auto":
        chosen = "auto: " + ("the first CUDA device" if cuda else "the CPU, no CUDA device")
    report.say(f"train.device: {chosen}")
    _check_device(report, config, "cpu", None, host_free)
    for device in devices:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        name = torch.cuda.get_device_name(torch.device(device))
        _check_device(report, config, device, (int(free), int(total), name), host_free)
    if not cuda and shutil.which("nvidia-smi") is not None:
        report.problem(
            "an NVIDIA driver is installed but this torch cannot use CUDA (a CPU build?): it would train "
            "on the CPU",
            "install a CUDA build of torch: SWARM_TORCH_SPEC='torch==<version>' scripts/setup.sh with the "
            "wheel for your CUDA (https://pytorch.org/get-started/locally/)",
            "check that `nvidia-smi` lists the GPU",
        )


def _check_device(
    report: Report, config: RunConfig, device: str, cuda: tuple[int, int, str] | None, host_free: int
) -> None:
    from swarm.learning.estimate import estimate_peer, format_bytes
    from swarm.learning.fit import fit_peer

    estimate = estimate_peer(config, "cpu" if cuda is None else "cuda")
    device_bytes = None if cuda is None else cuda[0]  # what is free now is what the trainer gets
    fit = fit_peer(config, estimate, device_bytes, host_free)
    micro, need, fits = micro_batch(config, estimate, fit.layout.host_state, device_bytes, host_free)
    if cuda is None:
        label = f"device cpu ({os.cpu_count()} cores, {format_bytes(host_free)} of host memory available)"
        needs = f"needs {format_bytes(need)} of host memory"
    else:
        free, total, name = cuda
        label = f"device {device} {name} ({format_bytes(free)} free of {format_bytes(total)})"
        host = format_bytes(fit.layout.host_bytes)
        needs = f"{fit.layout.name}: needs {format_bytes(need)} on the device, {host} of host memory"
    taken = "set by train.micro_batch_size" if config.train.micro_batch_size else _micro_origin(cuda)
    verdict = "fits" if fit.fits and fits else "does NOT fit"
    report.say(f"{label}: {verdict}; micro-batch {micro} ({taken}) {needs}")
    if not (fit.fits and fits):
        advice = fit.advice or ["set train.activation_checkpointing: true, or a smaller micro-batch"]
        report.problem(f"one peer of this run does not fit {device}", *advice)


def _micro_origin(cuda: tuple[int, int, str] | None) -> str:
    if cuda is None:
        return "the whole batch: on the CPU the trainer halves it only on out-of-memory"
    return "the largest that fits, estimated; the trainer measures it"


def micro_batch(
    config: RunConfig, estimate: PeerEstimate, host_state: bool, device_bytes: int | None, host_bytes: int
) -> tuple[int, int, bool]:
    """``(micro-batch, bytes the peer then needs, whether that fits)``: the configured micro-batch, the
    whole batch on the CPU (as the trainer takes it), else the largest of ``batch_size,
    batch_size // 2, ...`` whose activations fit the device (``device_bytes`` free) with the rest of
    the peer."""
    from swarm.learning.fit import DEVICE_HEADROOM

    checkpointing = config.train.activation_checkpointing
    cpu = device_bytes is None

    def need(size: int) -> int:
        scaled = dataclasses.replace(
            estimate,
            activations=estimate.activations * size,
            activations_checkpointed=estimate.activations_checkpointed * size,
        )
        if cpu:
            return scaled.memory(checkpointing)
        return scaled.device_memory(checkpointing, host_state=host_state)

    limit = host_bytes if cpu else DEVICE_HEADROOM * (device_bytes or 0)
    size = config.train.micro_batch_size or config.train.batch_size
    while not cpu and not config.train.micro_batch_size and size > 1 and need(size) > limit:
        size //= 2
    return size, need(size), need(size) <= limit


# ---------------------------------------------------------------- disk


def check_disk(report: Report, config: RunConfig) -> None:
    """Free disk where the checkpoints and the spooled state (served to joiners) go."""
    from swarm.learning.estimate import estimate_peer, format_bytes
    from swarm.state import default_spool_dir
    from swarm.trainer import checkpoint_dir_of

    estimate = estimate_peer(config, "cpu")
    checkpoint = estimate.weights + estimate.inner_optimizer + estimate.outer_state
    spool = SPOOLED_STATES * SPOOL_BYTES_PER_PARAMETER * estimate.parameters
    directory = checkpoint_dir_of(config)
    if directory is None:
        report.problem(
            "train.checkpoint_dir is null: this peer keeps no checkpoints, so its work can be neither "
            "resumed (--resume) nor exported (swarm export --checkpoint)",
            "leave train.checkpoint_dir out (checkpoints under $SWARM_HOME)",
            "or --set train.checkpoint_dir=DIR",
        )
        report.say(f"disk: no checkpoints kept (each would take about {format_bytes(checkpoint)})")
    else:
        _check_free(report, "checkpoints", directory, (CHECKPOINTS_KEPT + 1) * checkpoint)
    spool_dir = directory if directory is not None else Path(default_spool_dir())
    _check_free(report, "state spool", spool_dir, spool)


def _check_free(report: Report, what: str, directory: Path, needed: int) -> None:
    from swarm.learning.estimate import format_bytes

    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    report.say(f"disk: {what} in {directory}: {format_bytes(free)} free, about {format_bytes(needed)} needed")
    if free < needed + DISK_MARGIN:
        report.problem(
            f"not enough free disk for the {what} in {directory}: {format_bytes(free)} free, about "
            f"{format_bytes(needed)} needed plus {format_bytes(DISK_MARGIN)} to spare",
            "free some space on that disk",
            "or point SWARM_HOME (or --set train.checkpoint_dir=DIR) at a disk with more room",
        )
    elif not os.access(existing, os.W_OK):
        report.problem(
            f"{existing} is not writable: the {what} cannot be written",
            "point SWARM_HOME (or --set train.checkpoint_dir=DIR) at a directory you own",
        )


# ---------------------------------------------------------------- dial-back


def check_reachability(report: Report, config: RunConfig, network: NetworkOptions, public_name: str) -> None:
    """Whether other peers can dial this machine back at the addresses a join with these flags would
    announce: the join's own check (:meth:`swarm.SwarmNode.check_reachability`)."""
    if not network.initial_peers:
        report.say(
            "reachability: not checked (no --initial-peers); run swarm doctor --initial-peers <address> "
            "with the --port/--public-ip you will join with"
        )
        return
    if network.client_mode:
        report.say("reachability: not checked (--client-mode: this peer only dials out)")
        return
    from swarm import NodeInfo

    run, name = config.run, public_name[:64]
    info = NodeInfo(run.run_id, config.config_hash(), "averager", name, member_shards=run.member_shards)
    node = common.open_node(network, info, config)
    try:
        result = node.check_reachability()
    finally:
        node.close()
    if result.status != "unreachable":
        for line in common.reachability_lines(result, "doctor") or ["doctor: reachability not checked"]:
            report.say(line)
        return
    port = next((m.group(1) for a in result.addresses if (m := re.search(r"/tcp/(\d+)", a))), "N")
    report.say(f"doctor: no peer could dial this machine back at {', '.join(result.addresses)}")
    report.problem(
        f"no peer of the swarm could dial this machine back (asked {len(result.answered_by)}): a join "
        "would run in client mode, starting exchanges but never picked as a partner",
        f"open TCP port {port} in your firewall and forward it on your router to this machine",
        f"pass --public-ip YOUR_PUBLIC_IP --port {port} (to swarm doctor and swarm join)",
        "or pass --behind-nat: the initial peers then relay streams to you",
    )
