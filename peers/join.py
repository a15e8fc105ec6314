"""`swarm join`: join a run through an initial peer and train, printing one line per sync."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import typer

from peers._common import close_relay, fail, reachability_lines, start_relay
from peers._trainer_output import open_with_output, write_summary
from swarm.config import RunConfig
from swarm.network import NetworkOptions


def run_join(
    config: RunConfig,
    network: NetworkOptions,
    *,
    public_name: str,
    resume: bool,
    summary_path: Path | None,
    history_path: Path | None = None,
    stop: threading.Event,
    stage: str = "auto",
    check_swarm: bool = True,
) -> None:
    """Train in the swarm until ``stop`` is set or the run's step/sample limit is reached.

    First the config is checked against the swarm's (exit 2 when it cannot train there), unless
    ``check_swarm`` is off because the caller fetched it from the swarm and checked it on the way. With
    ``pipeline.num_stages > 1`` the peer serves one pipeline stage instead (``stage``: ``auto`` or its
    index; peers/stage.py)."""
    stages = _stages(config)
    if stages > 1:
        from peers.stage import parse_stage, run_stage_peer

        if resume:
            fail(
                f"--resume: pipeline stage peers (pipeline.num_stages is {stages}) keep no checkpoints "
                "yet, so there is nothing to resume from; join without --resume"
            )

        run_stage_peer(
            config,
            network,
            stage=parse_stage(stage, stages),
            public_name=public_name,
            summary_path=summary_path,
            history_path=history_path,
            stop=stop,
        )
        return
    if stage != "auto":
        fail(f"--stage {stage}: this run has no pipeline (pipeline.num_stages is 1)")
    from peers._compat_check import check_swarm_config
    from swarm.state import CheckpointError
    from swarm.trainer import TrainingPeer

    if check_swarm:
        check_swarm_config(config, network)
    relay = None
    peer, output = open_with_output(
        lambda on_sync: TrainingPeer(
            config, network, public_name=public_name, resume=resume, on_sync=on_sync
        ),
        config,
        history_path,
        bad_input=(CheckpointError, ValueError),
    )
    try:
        resumed = f", resumed from {peer.resumed_from}" if peer.resumed_from else ""
        members = len(peer.node.members())
        typer.echo(
            f"peer {peer.node.peer_id} joined run {config.run.run_id!r} ({members} members visible, "
            f"{peer.n_params:,} parameters on {peer.device}{resumed})"
        )
        output.joined(peer.node.record())
        reachable = peer.check_reachability()
        for line in reachability_lines(reachable, "join"):
            typer.echo(line)
        relay = _maybe_relay(peer, network, reachable.status)
        with peer.aborting_on(stop):  # a stalled exchange while joining must not hold a shutdown either
            peer.join_swarm()
        joined = peer.join_result
        if joined.donors:
            meta = joined.meta
            typer.echo(
                f"join: took over the swarm's state from {len(joined.donors)} donor(s): "
                f"round {meta.get('round')}, step {meta.get('step')}, samples {meta.get('samples_total')} "
                f"(digest {joined.digest[:12]})"
            )
        with output:
            peer.run(stop)
        typer.echo(f"join: shutting down: {_where_it_stopped(peer)}")
        with peer.phases.stop.part("checkpoint"):
            saved = peer.save_checkpoint()
        if saved is not None:
            typer.echo(
                f"join: checkpoint saved in {config.train.checkpoint_dir} "
                f"(step {peer.progress.step}, {peer.phases.stop.seconds['checkpoint']:.1f} s)"
            )
        summary = peer.summary() if summary_path is not None else None
    finally:
        with peer.phases.stop.part("leave"):
            if relay is not None:
                close_relay(relay, "join")
            peer.close()
    typer.echo(f"join: left the swarm in {peer.phases.stop.seconds['leave']:.1f} s{_since_stop(peer)}")
    if summary is not None and summary_path is not None:
        write_summary(peer, summary_path, summary)


def _maybe_relay(peer, network: NetworkOptions, reachability: str):
    """With ``--relay``, relay for peers behind NAT, unless this peer cannot be dialled itself."""
    if not network.relay:
        return None
    if peer.node.client_mode or reachability == "relay":
        typer.echo("join: --relay is set, but this peer is not directly reachable: not relaying")
        return None
    typer.echo("join: relaying for peers behind NAT that list this peer among their initial peers")
    return start_relay(peer.node)


def _where_it_stopped(peer) -> str:
    """Why and where the loop ended; after a stop, how long the loop took to end."""
    at = f"step {peer.progress.step}, round {peer.progress.round}"
    stop = peer.phases.stop.summary()
    if stop is None:
        return f"the run's limit reached at {at}"
    return f"stopped at {at}, the loop ended {stop['loop_s'] or 0.0:.1f} s after the stop"


def _since_stop(peer) -> str:
    if peer.stop_seen_at is None:
        return ""
    return f", {time.monotonic() - peer.stop_seen_at:.1f} s after the stop"


def _stages(config: RunConfig) -> int:
    """How many stages the run cuts the model into; exits 2 when the pipeline section cannot work."""
    from swarm.pipeline import plan_stages

    try:
        return len(plan_stages(config))
    except ValueError as exc:
        fail(str(exc))
