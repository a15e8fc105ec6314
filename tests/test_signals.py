"""peers._signals: the first SIGINT/SIGTERM sets the shutdown event, a second interrupts at once, and
neither can hang the process.

Each case runs in its own interpreter, because a handler that deadlocks hangs the process it runs in,
and signals reach only the main thread. The old handler called ``Event.set`` and so took the event's
lock. A signal that landed while that lock was held (the main thread inside ``stop.wait``, or a first
handler still inside ``set``) then waited on itself forever. These cases hold that lock on purpose:
against the old handler they hang, and hit the deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from peers.bootstrap import JOIN_LINE_PREFIX
from tests._processes import _catches, join_address, session_processes, swarm_cli, wait_until

HANG_S = 60.0  # a deadline for a hang, not synchronisation: each case takes well under a second

PRELUDE = """
import signal, threading
from peers._signals import shutdown_on_signals

def watchers():
    return [t for t in threading.enumerate() if t.name == "swarm-signals"]

original = signal.getsignal(signal.SIGTERM)
"""


def _run(body: str) -> list[str]:
    """Run ``body`` after PRELUDE in a fresh interpreter; return what it printed, line by line."""
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_sets_the_event_and_leaving_restores_the_handlers(signum: str) -> None:
    printed = _run(f"""
        with shutdown_on_signals() as stop:
            print("before", stop.is_set(), len(watchers()))
            signal.raise_signal(signal.{signum})
            print("after", stop.wait({HANG_S}))
        print("left", signal.getsignal(signal.SIGTERM) is original, len(watchers()))
    """)
    assert printed == ["before", "False", "1", "after", "True", "left", "True", "0"]


def test_a_signal_while_the_main_thread_holds_the_events_lock_still_sets_it() -> None:
    """The main thread of `while not stop.wait(1.0)` holds the event's lock for a moment on every
    call: a signal landing there must not wait on it."""
    printed = _run(f"""
        with shutdown_on_signals() as stop:
            with stop._cond:  # the lock Event.wait and Event.set take
                signal.raise_signal(signal.SIGTERM)
                print("handled")
            print("set", stop.wait({HANG_S}))
    """)
    assert printed == ["handled", "set", "True"]


def test_a_second_signal_before_the_event_is_set_interrupts_at_once() -> None:
    """The window where a first handler is still setting the event: the second signal must raise
    KeyboardInterrupt there, not wait for the first."""
    printed = _run("""
        try:
            with shutdown_on_signals() as stop:
                with stop._cond:
                    signal.raise_signal(signal.SIGTERM)
                    signal.raise_signal(signal.SIGTERM)
                    print("not-interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        print("left", signal.getsignal(signal.SIGTERM) is original, len(watchers()))
    """)
    assert printed == ["interrupted", "left", "True", "0"]


def test_a_forked_child_ignores_the_handler_it_inherits() -> None:
    """hivemind's DHT worker is forked while the handler is installed; its owner shuts it down."""
    printed = _run("""
        import os
        with shutdown_on_signals() as stop:
            pid = os.fork()
            if pid == 0:
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGTERM)  # would raise KeyboardInterrupt in the owner
                os._exit(7)
            _, status = os.waitpid(pid, 0)
        # leaving joins the watcher after it read every byte written before: a byte from the child too
        print("child", os.waitstatus_to_exitcode(status), "owner", stop.is_set())
    """)
    assert printed == ["child", "7", "owner", "False"]


def test_a_start_up_interrupt_lost_in_an_at_fork_hook_still_ends_start_up() -> None:
    """Python prints and drops an exception raised in an at-fork hook (logging has one): the signal
    that landed there must still end start-up at the next boundary, not let the run go on."""
    printed = _run("""
        import os
        from peers._signals import end_if_stopped, mark_started
        with shutdown_on_signals(starting=True) as stop:
            os.register_at_fork(after_in_parent=lambda: signal.raise_signal(signal.SIGINT))
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            print("lost", stop.interrupted)
            try:
                mark_started(stop)
                print("started")
            except KeyboardInterrupt:
                print("ended", stop.starting)
    """)
    assert printed == ["lost", "True", "ended", "True"]


def test_a_start_up_interrupt_is_never_raised_inside_loggings_lock_handling() -> None:
    """Raised between logging's acquire and release (its at-fork hooks, a handler's emit), it would
    leave the lock held and the next log line waiting forever. The code below runs as if it were
    logging's own (its file name); the interrupt must come at the next boundary instead."""
    printed = _run("""
        import logging
        from peers._signals import end_if_stopped
        inside_logging = compile(
            "logging._acquireLock()\\nsignal.raise_signal(signal.SIGINT)\\nlogging._releaseLock()",
            logging.__file__,
            "exec",
        )
        with shutdown_on_signals(starting=True) as stop:
            try:
                exec(inside_logging, {"logging": logging, "signal": signal})
                print("deferred", stop.interrupted)
                end_if_stopped(stop)
            except KeyboardInterrupt:
                print("ended")
        print("lock-free", logging._lock.acquire(timeout=5))
    """)
    assert printed == ["deferred", "True", "ended", "lock-free", "True"]


# ---------------------------------------------------------------- Ctrl+C of the programs themselves
# A terminal's Ctrl+C signals the whole foreground process group: the program, its DHT worker, p2pd.
# Each case sends SIGINT to the group of a real `swarm` process at one moment of its life and checks
# what a person sees: one line, no traceback, no daemon noise, the exit status. The time each took is
# printed (run with -s), not asserted.

NOISE = ("Traceback", "[ERROR]", "[WARN]", "KeyboardInterrupt")


def _ctrl_c(process) -> float:
    """SIGINT to ``process``'s group (a terminal's Ctrl+C); return the seconds until it exited."""
    started = time.monotonic()
    os.killpg(process.proc.pid, signal.SIGINT)
    try:
        process.proc.wait(timeout=HANG_S)
    finally:  # the time is the program's, not that of torch's shm manager, which holds its output a while
        took = time.monotonic() - started
        process.wait(timeout=HANG_S)
    return took


def _quiet(output: str) -> None:
    noisy = [line for line in output.splitlines() if any(word in line for word in NOISE)]
    assert not noisy, output


def test_ctrl_c_during_the_imports_ends_start_up_in_one_line(spawn) -> None:
    boot = spawn(swarm_cli("bootstrap"))
    # the start-up handler is the first thing peers/cli.py installs (SIGTERM has no handler before)
    wait_until(lambda: _catches(boot.proc.pid, signal.SIGTERM), timeout=HANG_S, what="the start-up handler")
    took = _ctrl_c(boot)
    print(f"ctrl+c during start-up: exited in {took:.2f}s")
    assert boot.proc.returncode == 130
    assert boot.output() == "swarm: interrupted, exiting"


def test_ctrl_c_while_the_dht_starts_leaves_no_traceback_and_no_join_line(spawn) -> None:
    boot = spawn(swarm_cli("bootstrap"))
    wait_until(lambda: psutil.Process(boot.proc.pid).children(), timeout=HANG_S, what="the DHT worker")
    took = _ctrl_c(boot)
    output = boot.output()
    print(f"ctrl+c while the DHT starts: exited in {took:.2f}s with {boot.proc.returncode}")
    _quiet(output)
    if JOIN_LINE_PREFIX in output:  # the machine was quicker than us: it had started, and stopped cleanly
        assert boot.proc.returncode == 0
    else:
        assert boot.proc.returncode == 130 and output.splitlines()[-1] == "bootstrap: shutting down"
    wait_until(lambda: not session_processes({boot.sid}), timeout=HANG_S, what="its DHT worker and p2pd")


def test_ctrl_c_of_a_running_bootstrap_and_monitor_is_quiet(spawn) -> None:
    """Before: the daemon, signalled too, died first ("[ERROR] ... use of closed network connection"),
    and hivemind waited its 3 s grace period for the DHT worker ("[WARN] DHT did not shut down")."""
    boot = spawn(swarm_cli("bootstrap"))
    maddr = join_address(boot)
    monitor = spawn(swarm_cli("monitor", "--initial-peers", maddr, "--format", "jsonl"))
    monitor.wait_for_line(lambda line: line.startswith('{"schema_version"'), timeout=HANG_S)
    took = _ctrl_c(monitor)
    print(f"ctrl+c of a running monitor: exited in {took:.2f}s")
    assert monitor.proc.returncode == 0 and monitor.lines[-1] == "monitor: stopping"
    _quiet(monitor.output())
    took = _ctrl_c(boot)
    print(f"ctrl+c of a running bootstrap: exited in {took:.2f}s")
    assert boot.proc.returncode == 0
    _quiet(boot.output())
    assert boot.lines[-2:] == ["bootstrap: shutting down", boot.lines[-1]]
    assert boot.lines[-1].startswith("bootstrap: summary: up ")


def test_ctrl_c_while_a_join_starts_ends_it_without_training_or_a_checkpoint(spawn, tmp_path) -> None:
    """Before: a Ctrl+C during a join's start-up was only noted; the peer joined, trained, stopped a
    round later and saved a checkpoint of a model it had hardly touched."""
    # the swarm's config is the join's: a join refused for another config exits 2 once it has read it,
    # which a Ctrl+C that lands a moment later could not change
    boot = spawn(swarm_cli("bootstrap", "--config", "configs/local-tiny.yaml"))
    maddr = join_address(boot)
    checkpoints = tmp_path / "checkpoints"
    sets = ["--set", f"train.checkpoint_dir={checkpoints}"]
    join = spawn(swarm_cli("join", "--initial-peers", maddr, "--config", "configs/local-tiny.yaml", *sets))
    # its DHT worker is up: start-up is under way (fetching the swarm's config, joining, downloading)
    wait_until(lambda: psutil.Process(join.proc.pid).children(), timeout=HANG_S, what="the join's DHT worker")
    took = _ctrl_c(join)
    print(f"ctrl+c while a join starts: exited in {took:.2f}s with {join.proc.returncode}")
    _quiet(join.output())
    assert join.proc.returncode == 130, join.output()
    assert not list(checkpoints.glob("ckpt-*.pt")), "a start-up that was interrupted saved a checkpoint"
    wait_until(lambda: not session_processes({join.sid}), timeout=HANG_S, what="its DHT worker and p2pd")
    assert _ctrl_c(boot) < HANG_S and boot.proc.returncode == 0
