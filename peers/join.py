"""`swarm join`: join a run through an initial peer and train, printing one line per sync."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from peers._common import close_relay, fail, reachability_lines, start_relay
from peers._signals import end_if_stopped
from peers._trainer_output import checkpoint_line, open_with_output, run_and_leave
from swarm.config import RunConfig
from swarm.network import NetworkOptions

if TYPE_CHECKING:
    from swarm.p2p import RelayForwarder
    from swarm.state.checkpoint import DirectoryLock


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
    if resume and config.train.checkpoint_dir is None:
        fail("--resume needs train.checkpoint_dir (where the checkpoints to resume from are)")
    config, lock = _claim_checkpoints(config, network, public_name)
    typer.echo(checkpoint_line(config))
    try:
        _run_join(
            config,
            network,
            public_name=public_name,
            resume=resume,
            summary_path=summary_path,
            history_path=history_path,
            stop=stop,
            stage=stage,
            check_swarm=check_swarm,
        )
    finally:
        if lock is not None:
            lock.release()


def _claim_checkpoints(
    config: RunConfig, network: NetworkOptions, public_name: str
) -> tuple[RunConfig, DirectoryLock | None]:
    """``config`` with its checkpoint directory resolved and locked for this process (exit 2 when a
    live peer holds an explicitly given one); ``auto`` is named after this peer (:func:`peer_name`)."""
    from swarm.state.checkpoint import DirectoryLockedError
    from swarm.trainer import claim_checkpoint_dir

    try:
        return claim_checkpoint_dir(config, peer_name(network, public_name))
    except DirectoryLockedError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot use the checkpoint directory: {exc}")


def peer_name(network: NetworkOptions, public_name: str) -> str:
    """What names this peer's ``auto`` checkpoint directory, stable across restarts where it can be:
    its public name, else the peer id of its identity file, else ``peer``."""
    if public_name:
        return public_name
    if network.identity_path is not None:
        from swarm.network import IdentityError, peer_id_of_identity

        try:
            return peer_id_of_identity(network.resolved_identity_path())
        except IdentityError:
            pass  # opening the node names the problem with the identity file
    return "peer"


def _run_join(
    config: RunConfig,
    network: NetworkOptions,
    *,
    public_name: str,
    resume: bool,
    summary_path: Path | None,
    history_path: Path | None,
    stop: threading.Event,
    stage: str,
    check_swarm: bool,
) -> None:
    stages = _stages(config)
    if stages > 1:
        from peers.stage import parse_stage, run_stage_peer

        run_stage_peer(
            config,
            network,
            stage=parse_stage(stage, stages),
            public_name=public_name,
            resume=resume,
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
        end_if_stopped(stop)  # Ctrl+C while the swarm's config was read: open no peer
    peer, output = open_with_output(
        lambda on_sync: TrainingPeer(
            config, network, public_name=public_name, resume=resume, on_sync=on_sync
        ),
        config,
        history_path,
        bad_input=(CheckpointError, ValueError),
    )
    relays: list[RelayForwarder] = []  # at most one: this peer's, with --relay

    def join() -> None:
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
        if relay is not None:
            relays.append(relay)
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

    def close_relays() -> None:
        for relay in relays:
            close_relay(relay, "join")

    run_and_leave(peer, output, stop, summary_path, join=join, before_close=close_relays)


def _maybe_relay(peer, network: NetworkOptions, reachability: str):
    """With ``--relay``, relay for peers behind NAT, unless this peer cannot be dialled itself."""
    if not network.relay:
        return None
    if peer.node.client_mode or reachability == "relay":
        typer.echo("join: --relay is set, but this peer is not directly reachable: not relaying")
        return None
    typer.echo("join: relaying for peers behind NAT that list this peer among their initial peers")
    return start_relay(peer.node)


def _stages(config: RunConfig) -> int:
    """How many stages the run cuts the model into; exits 2 when the pipeline section cannot work."""
    from swarm.pipeline import plan_stages

    try:
        return len(plan_stages(config))
    except ValueError as exc:
        fail(str(exc))
