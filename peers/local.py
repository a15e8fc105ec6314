"""`swarm local`: a whole swarm on this machine, a bootstrap and N peers as subprocesses.

Each child runs in its own session, so that what it started (the DHT worker process and its ``p2pd``)
can be found: at the end each peer gets SIGTERM and must take all of it down by itself (see
:meth:`LocalSwarm.stop`); whatever outlives its peer is killed, named, and makes the command exit 1.
Children also get ``PR_SET_PDEATHSIG`` so that they go down with the launcher even if the launcher
itself is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import typer
from rich.live import Live
from rich.table import Table

from peers._common import SHUTDOWN_GRACE_S, open_node
from peers.bootstrap import JOIN_LINE_PREFIX
from peers.local_summary import collect, print_summary, swarm_summary
from peers.monitor import observer_info
from swarm.config import RunConfig
from swarm.network import NetworkOptions

_PR_SET_PDEATHSIG = 1
ORPHAN_WAIT_S = 30.0
"""How long the DHT worker and ``p2pd`` of a peer that has exited may take to end by themselves."""


@dataclass
class LocalSwarm:
    """The processes of a local swarm and where their logs go."""

    log_dir: Path
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (the child owns it from here)
        proc = subprocess.Popen(
            [sys.executable, "-m", "peers.cli", *args],
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()
        self.processes.append((name, proc))
        return proc

    def alive(self) -> list[str]:
        return [name for name, proc in self.processes if proc.poll() is None]

    def stop(self) -> list[str]:
        """Stop every peer; return what outlived its own peer (then SIGKILLed), as descriptions.

        Only a peer's main process gets SIGTERM: it stops its own DHT worker and daemon in order. One
        still running after the grace period is SIGKILLed alone (said on stderr): its DHT worker then
        notices and stops ``p2pd`` by itself. Either way, once a peer's main process is gone nothing
        of its session may remain: what is still there after :data:`ORPHAN_WAIT_S` is a leak, and
        only that is killed.
        """
        terminate_and_wait([proc for _, proc in self.processes], SHUTDOWN_GRACE_S)
        for name, proc in self.processes:
            if proc.poll() is None:
                typer.echo(f"[local] {name} did not stop within {SHUTDOWN_GRACE_S:g} s; killed it", err=True)
                proc.kill()
                proc.wait()
        return kill_leftovers({proc.pid for _, proc in self.processes})


def cpu_threads_env(peers: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``peers`` processes sharing this machine's cores.

    torch uses one thread per core by default; N peers doing that on the same cores oversubscribe
    them, and a tiny model's step then takes several times longer (measured: 10x with 6 processes
    on 2 busy cores). A value the user set is kept.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, peers)))}


def die_with_parent() -> None:
    """A ``preexec_fn`` for a child process: SIGTERM it when the process that started it dies, even by
    SIGKILL (``PR_SET_PDEATHSIG``), so that no peer outlives its launcher."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate_and_wait(procs: Sequence[subprocess.Popen], grace_s: float) -> list[subprocess.Popen]:
    """SIGTERM each of ``procs`` still running, then wait up to ``grace_s`` in all for them to exit;
    return those still running (the caller decides whether to kill them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    return [proc for proc in procs if proc.poll() is None]


def session_processes(sessions: set[int]) -> list[psutil.Process]:
    """Live (non-zombie) processes in one of ``sessions`` (each peer leads its own)."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) in sessions:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def kill_leftovers(sessions: set[int], wait_s: float = ORPHAN_WAIT_S) -> list[str]:
    """Once the sessions' leaders have exited: what of ``sessions`` is still running after ``wait_s``
    (a DHT worker finishing its daemon's shutdown takes a moment), described, then killed."""
    deadline = time.monotonic() + wait_s
    while (left := session_processes(sessions)) and time.monotonic() < deadline:
        time.sleep(0.1)  # nothing to wait on but the process table
    outlived = [describe_process(p) for p in left]
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=10)
    return outlived


def describe_process(proc: psutil.Process) -> str:
    try:
        return f"{proc.name()} (pid {proc.pid})"
    except psutil.Error:
        return f"pid {proc.pid}"


def wait_for_join_line(log_path: Path, proc: subprocess.Popen, timeout_s: float) -> str:
    """Read the bootstrap's log until its join line appears; return the multiaddr in it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(JOIN_LINE_PREFIX):
                return line[len(JOIN_LINE_PREFIX) :].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"bootstrap exited with status {proc.returncode}; see {log_path}")
        time.sleep(0.1)  # polling a file another process writes; there is nothing to wait on
    raise RuntimeError(f"bootstrap printed no join line within {timeout_s:.0f}s; see {log_path}")


def run_local(
    config: RunConfig,
    *,
    peers: int,
    duration_s: float | None,
    config_path: str | None,
    overrides: list[str],
    log_dir: Path,
    summary_path: Path | None = None,
    stop: threading.Event,
    stages: str = "round-robin",
) -> int:
    """Run a bootstrap and ``peers`` trainers until they finish, ``duration_s`` passes or ``stop`` is set.

    A pipelined run (``pipeline.num_stages > 1``) gives peer ``i`` stage ``(i - 1) mod S`` (``stages``
    ``round-robin``), or lets each choose the least served one as it joins (``auto``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    common = (["--config", config_path] if config_path else []) + [a for o in overrides for a in ("--set", o)]
    swarm = LocalSwarm(log_dir, env=cpu_threads_env(peers))
    status, outlived = 1, []
    try:
        boot = swarm.spawn("bootstrap", ["bootstrap", *common, "--public-name", "local-bootstrap"])
        maddr = wait_for_join_line(log_dir / "bootstrap.log", boot, timeout_s=60)
        typer.echo(f"[local] bootstrap up at {maddr}")
        for index in range(1, peers + 1):
            args = _trainer_args(common, maddr, index, log_dir) + _stage_args(config, index, stages)
            swarm.spawn(f"peer-{index}", args)
        typer.echo(f"[local] started {peers} peers; logs in {log_dir}")
        observer_network = NetworkOptions(initial_peers=[maddr], client_mode=True)
        with open_node(observer_network, observer_info(config), config, announce=False) as observer:
            status = _supervise(swarm, duration_s, stop, observer.members)
    finally:
        typer.echo("[local] stopping all peers")
        outlived = swarm.stop()
        if outlived:
            typer.echo(f"[local] outlived their peer, killed: {', '.join(outlived)}", err=True)
        typer.echo("[local] all peers stopped")
    _finish(config, log_dir, peers, summary_path)
    return 1 if outlived else status


def _stage_args(config: RunConfig, index: int, stages: str) -> list[str]:
    """``--stage`` for peer ``index`` of a pipelined run (none otherwise)."""
    from swarm.pipeline import resolve_num_stages

    count = resolve_num_stages(config)
    if count <= 1:
        return []
    return ["--stage", "auto" if stages == "auto" else str((index - 1) % count)]


def _trainer_args(common: list[str], maddr: str, index: int, log_dir: Path) -> list[str]:
    name = f"peer-{index}"
    return [
        "join",
        *common,
        "--initial-peers",
        maddr,
        "--public-name",
        name,
        "--summary",
        str(log_dir / f"{name}.summary.json"),
        "--history",
        str(log_dir / f"{name}.history.jsonl"),
        "--set",
        f"train.checkpoint_dir={log_dir / name / 'checkpoints'}",
    ]


def _supervise(swarm: LocalSwarm, duration_s: float | None, stop: threading.Event, members: Callable) -> int:
    """Show progress until the trainers finish, the duration passes or ``stop``; 1 if a peer failed.

    On a terminal the progress is a live table redrawn in place; otherwise one plain line per tick.
    """
    if not sys.stdout.isatty():
        return _watch(swarm, duration_s, stop, members, _print_line, every_s=5.0)
    with Live(progress_table(members(), 0.0), refresh_per_second=2, transient=False) as live:
        return _watch(swarm, duration_s, stop, members, lambda ms, t: live.update(progress_table(ms, t)), 2.0)


def _print_line(members: list, elapsed: float) -> None:
    typer.echo(f"[local] t={elapsed:4.0f}s {_progress_line(members)}")


def _watch(
    swarm: LocalSwarm,
    duration_s: float | None,
    stop: threading.Event,
    members: Callable,
    show: Callable[[list, float], None],
    every_s: float,
) -> int:
    started = time.monotonic()
    trainers = [(name, proc) for name, proc in swarm.processes if name != "bootstrap"]
    while not stop.wait(timeout=_next_tick(started, duration_s, every_s)):
        show(members(), time.monotonic() - started)
        failed = [name for name, proc in swarm.processes if proc.poll() not in (None, 0)]
        if failed:
            typer.echo(f"[local] peer(s) failed: {', '.join(failed)}; see their logs", err=True)
            return 1
        if all(proc.poll() == 0 for _, proc in trainers):
            typer.echo("[local] all trainers finished")
            return 0
        if duration_s is not None and time.monotonic() - started >= duration_s:
            return 0
    return 0


def progress_table(members: list, elapsed: float) -> Table:
    """The live view of `swarm local` on a terminal: one row per trainer."""
    table = Table(
        title=f"swarm local, {elapsed:.0f}s (losses in {_loss_unit(members)})", title_justify="left"
    )
    table.add_column("trainer", no_wrap=True, min_width=7)
    table.add_column("state", no_wrap=True)
    for column in ("step", "loss", "eval", "smp/s", "syncs", "drift"):
        table.add_column(column, justify="right", no_wrap=True)
    for m in _trainers(members):
        r = m.record
        table.add_row(
            r.public_name or m.peer_id[-6:],
            r.state,
            str(r.step),
            _fmt(r.loss, ".3f"),
            _fmt(r.eval_loss, ".3f"),
            _fmt(r.samples_per_s, ".1f"),
            str(r.exchanges_ok),
            _fmt(r.drift, ".4f"),
        )
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _loss_unit(members: list) -> str:
    """The unit the trainers' losses are in (one run: one unit)."""
    units = {m.record.loss_unit for m in _trainers(members)}
    return units.pop() if len(units) == 1 else "bits/byte"


def _trainers(members: list) -> list:
    return sorted((m for m in members if m.record.role == "trainer"), key=lambda m: m.record.public_name)


def _progress_line(members: list) -> str:
    trainers = _trainers(members)
    if not trainers:
        return "waiting for trainers"
    parts = []
    staged = any(m.record.stage for m in trainers)  # a pipelined run: say which stage each serves
    for m in trainers:
        r = m.record
        evaluation = f"{r.eval_loss:.2f}" if r.eval_loss is not None else "-"
        stage = f" stage {r.stage}" if staged else ""
        parts.append(f"{r.public_name or m.peer_id[-6:]}:{stage} step {r.step} eval {evaluation}")
    return f"{len(trainers)} trainers | " + " | ".join(parts) + f" ({_loss_unit(members)})"


def _finish(config: RunConfig, log_dir: Path, peers: int, summary_path: Path | None) -> None:
    """Collect the peers' summaries, print the table and write the JSON summary."""
    from swarm.learning import open_source, unigram_bits

    rows = collect([log_dir / f"peer-{i}.summary.json" for i in range(1, peers + 1)])
    if not rows:
        typer.echo("[local] no peer wrote a summary", err=True)
        return
    source = open_source(config.data)
    vocab = config.model.vocab_size
    baseline = unigram_bits(source.train, source.eval, vocab) if hasattr(source, "train") else None
    summary = swarm_summary(rows, baseline)
    print_summary(summary)
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2))
        typer.echo(f"[local] summary written to {summary_path}")


def _next_tick(started: float, duration_s: float | None, every_s: float = 5.0) -> float:
    if duration_s is None:
        return every_s
    return max(0.0, min(every_s, started + duration_s - time.monotonic()))
