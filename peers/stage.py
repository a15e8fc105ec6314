"""`swarm join` with ``pipeline.num_stages > 1``: serve one pipeline stage, one line per sync."""

from __future__ import annotations

import threading
from pathlib import Path

import typer

from peers._common import fail, reachability_lines
from peers._trainer_output import open_with_output, run_and_leave
from swarm.config import RunConfig
from swarm.network import NetworkOptions


def parse_stage(value: str, num_stages: int) -> int | str:
    """``auto`` or a stage index below ``num_stages``; exits 2 on anything else."""
    if value == "auto":
        return value
    try:
        stage = int(value)
    except ValueError:
        fail(f"--stage must be 'auto' or a stage number, got {value!r}")
    if not 0 <= stage < num_stages:
        fail(f"--stage {stage}: the run has stages 0..{num_stages - 1}")
    return stage


def run_stage_peer(
    config: RunConfig,
    network: NetworkOptions,
    *,
    stage: int | str,
    public_name: str,
    resume: bool,
    summary_path: Path | None,
    history_path: Path | None,
    stop: threading.Event,
) -> None:
    """Serve a stage until ``stop``, the step limit (data holders) or the end of the data holders."""
    from peers._compat_check import check_swarm_config
    from swarm.pipeline import StagePeer
    from swarm.state import CheckpointError

    check_swarm_config(config, network)
    peer, output = open_with_output(
        lambda on_sync: StagePeer(
            config, network, stage=stage, public_name=public_name, resume=resume, on_sync=on_sync
        ),
        config,
        history_path,
        bad_input=(CheckpointError, ValueError),
    )

    def join() -> None:
        for line in reachability_lines(peer.check_reachability(), "join"):
            typer.echo(line)
        with peer.aborting_on(stop):
            peer.join_swarm()
        role = "data holder" if peer.stage == 0 else "stage server"
        typer.echo(
            f"peer {peer.node.peer_id} joined run {config.run.run_id!r} as {role} of stage {peer.stage} "
            f"of {peer.num_stages} ({peer.n_params:,} parameters on {peer.device})"
        )
        output.joined(peer.node.record())

    run_and_leave(peer, output, stop, summary_path, join=join)
