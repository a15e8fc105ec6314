"""What a trainer shows: one concise line per sync, a progress bar on a terminal, an optional history."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from peers._common import fail
from swarm.config import RunConfig

if TYPE_CHECKING:
    from swarm.trainer import SyncReport

P = TypeVar("P")


def format_sync_line(report: SyncReport) -> str:
    """The per-sync line: round, losses and their unit, throughput, learning rate, partner, bytes, drift.

    Its words keep their positions (tests split the line on spaces): ``round R step S
    loss L eval E UNIT RATE samples/s lr=LR sync OUTCOME with PARTNER sent ... drift D``. A tokenized
    run (UNIT ``bits/token``) adds its held-out loss per byte, ``eval B bits/byte``, before ``drift``;
    so does a trainer's throughput, ``T tok/s mfu M mem X GiB`` (``-`` where unknown: MFU off the
    table of known GPUs, peak memory off CUDA).
    """
    partner = report.partner[-8:] if report.partner else "-"
    per_byte = ""
    if report.loss_unit != "bits/byte":
        per_byte = f"eval {_number(report.eval_bits_per_byte, '.3f')} bits/byte "
    if report.tokens_per_s is not None:
        mfu = "-" if report.mfu is None else f"{100 * report.mfu:.1f}%"
        memory = "-" if report.peak_memory_bytes is None else f"{report.peak_memory_bytes / 2**30:.2f}"
        per_byte += f"{report.tokens_per_s:.0f} tok/s mfu {mfu} mem {memory} GiB "
    return (
        f"round {report.round:4d} step {report.step:6d} loss {_number(report.loss, '.3f')} "
        f"eval {_number(report.eval_loss, '.3f')} {report.loss_unit} {report.samples_per_s:7.1f} samples/s "
        f"lr={report.lr:.2e} sync {report.outcome} with {partner} sent {report.bytes_sent / 1024:.1f} KiB "
        f"recv {report.bytes_received / 1024:.1f} KiB {per_byte}drift {_number(report.drift, '.4f')}"
    )


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class TrainerOutput:
    """Prints sync lines; on a terminal also keeps a progress bar of steps below them.

    When stdout is not a terminal (logs, pipes, `swarm local`), only the plain lines are printed, so
    they stay greppable.
    """

    def __init__(self, config: RunConfig, history: Path | None = None):
        self.console = Console(highlight=False)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if sys.stdout.isatty():
            self._progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=config.train.max_steps, status="")
        self._history = None
        if history is not None:
            from peers.monitor import snapshot_policy
            from swarm.metrics import HistoryWriter

            self._history = HistoryWriter(history, snapshot_policy(config))

    def __enter__(self) -> TrainerOutput:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def echo(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, soft_wrap=True)
        else:
            print(text, flush=True)

    def joined(self, record: Any) -> None:
        """The peer joined the swarm: the history's first line is its record then (step 0 for a fresh
        peer), so that a reader of the history knows when it started (the benchmarks' clock)."""
        if self._history is not None:
            from hivemind.utils.timed_storage import get_dht_time

            self._history.append_record(record, get_dht_time())

    def on_sync(self, report: SyncReport, record=None) -> None:
        """Print the sync line, advance the bar, append the peer's own snapshot to the history."""
        self.echo(format_sync_line(report))
        if self._progress is not None and self._task is not None:
            eval_text = (
                f"eval {report.eval_loss:.3f} {report.loss_unit}" if report.eval_loss is not None else ""
            )
            self._progress.update(
                self._task, completed=report.step, status=f"round {report.round} {eval_text}"
            )
        if self._history is not None and record is not None:
            from hivemind.utils.timed_storage import get_dht_time

            self._history.append_record(record, get_dht_time())


def open_with_output(
    open_peer: Callable[[Callable[[SyncReport], None]], P],
    config: RunConfig,
    history: Path | None,
    bad_input: tuple[type[Exception], ...] = (ValueError,),
) -> tuple[P, TrainerOutput]:
    """Open a training peer as ``open_peer(on_sync)``, its syncs shown by a new :class:`TrainerOutput`
    (which appends the peer's own record to ``history``); returns both.

    A ``bad_input`` error exits 2, a :class:`~swarm.network.NetworkError` exits 1 (`swarm join` and
    its pipeline stage peers alike).
    """
    from swarm.network import NetworkError

    output = TrainerOutput(config, history)
    peer: Any = None  # the callback reads it once the peer exists (its first sync comes later)
    try:
        peer = open_peer(lambda report: output.on_sync(report, peer.node.record()))
    except bad_input as exc:
        fail(str(exc))
    except NetworkError as exc:
        fail(str(exc), status=1)
    return peer, output


def write_summary(peer: Any, path: Path, summary: dict[str, Any] | None = None) -> None:
    """Write ``summary`` (``peer.summary()`` when None) with the peer's held-out evaluation of the final
    model, for `swarm local`'s summary table and the benchmarks. A whole-model trainer evaluates once
    it has left the swarm, so that this evaluation (the one piece of work a stop still starts, asked
    for by ``--summary``) holds up no partner; a second signal interrupts it. A pipeline data holder
    evaluates through the other stages, before it leaves. The summary's ``stop`` is read last, so that
    it holds every part of the way out timed so far, this evaluation included (``final_eval_s``)."""
    summary = peer.summary() if summary is None else summary
    with peer.phases.stop.part("final_eval"):
        evaluation = peer.final_evaluation()
    summary = {**summary, **evaluation, "stop": peer.phases.stop.summary()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))


def where_it_stopped(peer: Any) -> str:
    """Why and where the loop ended; after a stop, how long the loop took to end."""
    at = f"step {peer.progress.step}, round {peer.progress.round}"
    stop = peer.phases.stop.summary()
    if stop is None:
        return f"the run's limit reached at {at}"
    return f"stopped at {at}, the loop ended {stop['loop_s'] or 0.0:.1f} s after the stop"


def since_stop(peer: Any) -> str:
    """How long after the stop it is now (empty when the run ended by itself)."""
    if peer.stop_seen_at is None:
        return ""
    return f", {time.monotonic() - peer.stop_seen_at:.1f} s after the stop"


def run_and_leave(
    peer: Any,
    output: TrainerOutput,
    stop: threading.Event,
    summary_path: Path | None,
    *,
    join: Callable[[], None],
    before_close: Callable[[], None] = lambda: None,
) -> None:
    """The run every kind of peer shares once it is open (`swarm join`, whole-model or a stage).

    ``join()`` joins the swarm and prints what the kind of peer says of it; then the peer trains until
    ``stop`` or the run's limit, says where it stopped, saves the checkpoint of the way out (where it
    keeps them), leaves the swarm (``before_close()`` first, e.g. closing a relay) and writes the
    ``--summary``. ``peer`` is closed whatever happens.
    """
    summary = None
    try:
        join()
        with output:
            peer.run(stop)
        typer.echo(f"join: shutting down: {where_it_stopped(peer)}")
        with peer.phases.stop.part("checkpoint"):
            saved = peer.save_checkpoint()
        if saved is not None:
            typer.echo(
                f"join: checkpoint saved in {peer.config.train.checkpoint_dir} "
                f"(step {peer.progress.step}, {peer.phases.stop.seconds['checkpoint']:.1f} s)"
            )
        if summary_path is not None and peer.evaluates_alone:
            summary = peer.summary()  # the final evaluation waits until the swarm is left
        elif summary_path is not None:
            write_summary(peer, summary_path)
    finally:
        with peer.phases.stop.part("leave"):
            before_close()
            peer.close()
    typer.echo(f"join: left the swarm in {peer.phases.stop.seconds['leave']:.1f} s{since_stop(peer)}")
    if summary is not None and summary_path is not None:
        write_summary(peer, summary_path, summary)
