"""The processes of one membership benchmark run: where each peer runs, its network counters, its memory,
and a stop after which nothing of it may remain.

Every peer is ``python -m scripts._membership_probe ...`` (``swarm`` with its DHT RPCs counted) in a
session of its own, so that its DHT worker and ``p2pd`` can be found by session id. With ``netns``
each peer runs in its own network namespace of an unshaped lab (testbed/netlab.py, root only), whose
``eth0`` byte counters are that peer's whole traffic on the wire; on plain loopback there are no
such counters.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from peers.local import die_with_parent, kill_leftovers, session_processes, terminate_and_wait

REPO = Path(__file__).resolve().parent.parent
STOP_WAIT_S = 90.0
"""How long stopped peers get to exit by themselves: a leak check, not a timing (32 peers writing
checkpoints and summaries at once on two busy cores)."""
"""How long a peer's DHT worker and ``p2pd`` may take to end after the peer has exited."""


@dataclass
class Peer:
    """One process of the run (``bootstrap``, ``peer-<i>`` or ``monitor``) and its files."""

    name: str
    proc: subprocess.Popen
    log: Path
    rpc_file: Path
    netns: str | None = None
    ip: str = "127.0.0.1"


def _nice_child(niceness: int) -> None:
    """A ``preexec_fn``: lower the child's priority by ``niceness``, and end it with its parent.

    Each peer leads its own session, and with the kernel's autogroup scheduling each session is a
    group that shares the CPU equally with the others whatever its processes' nice values: the
    group's own niceness (``/proc/self/autogroup``) is what lowers it."""
    if niceness:
        os.nice(niceness)
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:
            group.write(str(niceness))
    die_with_parent()


@dataclass
class Swarm:
    """Starts peers on loopback or one per namespace (``lab``: a started ``testbed.netlab.NetLab``), at
    niceness ``nice`` unless a start says otherwise."""

    log_dir: Path
    run_id: str
    lab: Any = None
    nice: int = 0
    peers: dict[str, Peer] = field(default_factory=dict)

    def host_ip(self, slot: int) -> tuple[str | None, str]:
        """The namespace and address of slot ``slot`` (0: bootstrap, i: peer-i, then the monitor)."""
        if self.lab is None:
            return None, "127.0.0.1"
        host = self.lab.hosts[slot]
        return host.netns, host.ip

    def argv(self, slot: int, args: list[str], listen: bool = True) -> list[str]:
        """``swarm ARGS``, counted, in slot ``slot``'s namespace (if any), listening on its address."""
        netns, ip = self.host_ip(slot)
        command = [sys.executable, "-m", "scripts._membership_probe", *args]
        command += ["--host-maddrs", f"/ip4/{ip}/tcp/0"] if listen else []
        return ["ip", "netns", "exec", netns, *command] if netns else command

    def start(
        self,
        name: str,
        slot: int,
        args: list[str],
        *,
        listen: bool = True,
        env: dict[str, str] | None = None,
        nice: int | None = None,
    ) -> Peer:
        """Start ``swarm ARGS`` (counted) as ``name`` in slot ``slot``, with ``env`` added, at niceness
        ``nice`` (None: the swarm's); its stdout goes to ``<name>.out``, its stderr to ``<name>.log``
        (``listen``: give it the slot's address)."""
        log, rpc_file = self.log_dir / f"{name}.log", self.log_dir / f"{name}.rpc.json"
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MEMBERSHIP_BENCH_RPC_FILE": str(rpc_file),
            "MEMBERSHIP_BENCH_RUN_ID": self.run_id,
            **(env or {}),
        }
        with log.open("wb") as err, (self.log_dir / f"{name}.out").open("wb") as out:
            proc = subprocess.Popen(
                self.argv(slot, args, listen),
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=functools.partial(_nice_child, self.nice if nice is None else nice),
            )
        netns, ip = self.host_ip(slot)
        self.peers[name] = Peer(name, proc, log, rpc_file, netns, ip)
        return self.peers[name]

    def failed(self) -> dict[str, int]:
        """Peers that have exited (name -> status)."""
        return {n: p.proc.returncode for n, p in self.peers.items() if p.proc.poll() is not None}

    def wire_bytes(self) -> dict[str, dict[str, int]]:
        """Each namespaced peer's ``eth0`` counters, ``{name: {"tx": bytes, "rx": bytes}}`` (none on
        loopback)."""
        counters = {}
        for name, peer in self.peers.items():
            if peer.netns is None:
                continue
            link = subprocess.run(
                ["ip", "-n", peer.netns, "-j", "-s", "link", "show", "eth0"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            stats = json.loads(link.stdout)[0]["stats64"]
            counters[name] = {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}
        return counters

    def cpu_seconds(self) -> dict[str, float]:
        """Per peer, the CPU seconds (user + system) its live processes have used so far."""
        sessions = {p.proc.pid: n for n, p in self.peers.items() if p.proc.poll() is None}
        used = dict.fromkeys(sessions.values(), 0.0)
        for proc in session_processes(set(sessions)):
            with contextlib.suppress(psutil.Error, OSError):
                times = proc.cpu_times()
                used[sessions[os.getsid(proc.pid)]] += times.user + times.system
        return used

    def memory(self) -> dict[str, dict[str, int]]:
        """Per peer, resident and proportional (shared pages split) bytes of its processes: the peer
        (``main``), its DHT worker (a fork of it: ``worker``) and ``p2pd``."""
        sessions = {p.proc.pid: n for n, p in self.peers.items() if p.proc.poll() is None}
        usage: dict[str, dict[str, int]] = {n: {} for n in sessions.values()}
        for proc in session_processes(set(sessions)):
            with contextlib.suppress(psutil.Error, OSError):
                name = sessions[os.getsid(proc.pid)]
                part = _part(proc, proc.pid in sessions)
                info = proc.memory_full_info()
                row = usage[name]
                row[f"{part}_rss"] = row.get(f"{part}_rss", 0) + info.rss
                row["rss"] = row.get("rss", 0) + info.rss
                row["pss"] = row.get("pss", 0) + info.pss
        return usage

    def stop(self, names: list[str]) -> None:
        """SIGTERM ``names`` and wait for them (up to :data:`STOP_WAIT_S`); one still running is killed."""
        for proc in terminate_and_wait([self.peers[n].proc for n in names if n in self.peers], STOP_WAIT_S):
            proc.kill()
            proc.wait()

    def leftovers(self) -> list[str]:
        """After every peer has exited: what of their sessions outlived them (DHT workers, ``p2pd``),
        described; each is then killed. Empty after a clean stop."""
        return kill_leftovers({p.proc.pid for p in self.peers.values()})

    def kill_all(self) -> None:
        """SIGKILL every process of every peer's session (after a failure or Ctrl+C)."""
        for proc in session_processes({p.proc.pid for p in self.peers.values()}):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for peer in self.peers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                peer.proc.wait(timeout=10)


def _part(proc: psutil.Process, leader: bool) -> str:
    if leader:
        return "main"
    return "p2pd" if proc.name() == "p2pd" else "worker"


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file another process writes atomically; None while it is missing."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def signal_name(status: int | None) -> str:
    """An exit status as a reader wants it (``SIGKILL`` for -9)."""
    if status is not None and status < 0:
        return signal.Signals(-status).name
    return str(status)
