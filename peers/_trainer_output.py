"""What a trainer shows: one concise line per sync, a progress bar on a terminal, an optional history."""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from peers._common import fail
from peers._signals import mark_started
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


def checkpoint_line(config: RunConfig) -> str:
    """Where this peer's checkpoints go (said at start), or that it keeps none."""
    directory = config.train.checkpoint_dir
    if directory is None:
        return (
            "join: keeping no checkpoints (train.checkpoint_dir is null): this peer can neither --resume "
            "nor be exported from a checkpoint"
        )
    return (
        f"join: checkpoints go to {directory} (every {config.train.checkpoint_every_s:g} s and on the way "
        "out; --resume continues from them)"
    )


def export_command(directory: str) -> str:
    """The command that exports the model of the checkpoints in ``directory``."""
    return f"swarm export --checkpoint {shlex.quote(directory)} --out model"


@dataclass
class ExitSummary:
    """What a peer did, for the lines it prints as it exits: read before the peer closes."""

    samples: int
    swarm_samples: int
    exchanges_ok: int
    exchanges_failed: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    checkpoint: Path | None
    checkpoint_dir: str | None
    whole_model: bool

    @classmethod
    def of(cls, peer: Any, started: float, checkpoint: Path | None) -> ExitSummary:
        metrics = peer.exchange_metrics()
        progress = peer.progress
        return cls(
            samples=progress.samples_total,
            swarm_samples=max(progress.swarm_samples, progress.samples_total),
            exchanges_ok=metrics.exchanges_ok,
            exchanges_failed=metrics.exchanges_failed + metrics.exchanges_rejected,
            bytes_sent=metrics.bytes_sent,
            bytes_received=metrics.bytes_received,
            seconds=time.monotonic() - started,
            checkpoint=checkpoint,
            checkpoint_dir=peer.config.train.checkpoint_dir,
            whole_model=getattr(peer, "num_stages", 1) == 1,
        )

    def lines(self) -> list[str]:
        share = f" ({100 * self.samples / self.swarm_samples:.1f}%)" if self.swarm_samples else ""
        lines = [
            f"summary: trained {self.samples:,} samples of the swarm's {self.swarm_samples:,}{share} in "
            f"{_duration(self.seconds)}; exchanges {self.exchanges_ok} ok, {self.exchanges_failed} failed; "
            f"sent {_size(self.bytes_sent)}, received {_size(self.bytes_received)}"
        ]
        if self.checkpoint_dir is None:
            lines.append("summary: no checkpoint kept (train.checkpoint_dir is null)")
            return lines
        if self.checkpoint is None:
            lines.append(f"summary: no checkpoint written yet in {self.checkpoint_dir}")
            return lines
        lines.append(f"summary: checkpoint {self.checkpoint}")
        if self.whole_model:
            lines.append(f"summary: export the model with: {export_command(self.checkpoint_dir)}")
        else:
            lines.append("summary: a pipeline stage's checkpoint (swarm export takes whole-model ones)")
        return lines


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f} s"


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


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
    started = time.monotonic()
    try:
        mark_started(stop)  # the peer is open: a first Ctrl+C now stops it cleanly, joining included
        join()
        with output:
            peer.run(stop)
        typer.echo(f"join: shutting down: {where_it_stopped(peer)}")
        saved = None
        if peer.progress.step > 0:  # a peer stopped before its first step has nothing of its own to keep
            with peer.phases.stop.part("checkpoint"):
                saved = peer.save_checkpoint()
        if saved is not None:
            typer.echo(
                f"join: checkpoint saved in {peer.config.train.checkpoint_dir} "
                f"(step {peer.progress.step}, {peer.phases.stop.seconds['checkpoint']:.1f} s)"
            )
        at_exit = ExitSummary.of(peer, started, saved)
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
    for line in at_exit.lines():
        typer.echo(f"join: {line}")
