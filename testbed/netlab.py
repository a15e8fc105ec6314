"""An emulated internet on one machine: hosts in network namespaces on one bridge, links shaped by tc.

docs/testbed.md describes it. ``python -m testbed`` builds a demo lab or removes leftover ones
(testbed/__main__.py); the echo and sink servers the lab's checks use are testbed/_sockets.py.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed._sockets import SERVER_PORT

PREFIX = "swt-"
SUBNET = "10.77.0.0/24"
CMD_TIMEOUT_S = 10.0
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bps": 8, "kbps": 8e3, "mbps": 8e6}
_BRIDGE = "br0"
_BRIDGE_MAC = "02:77:00:00:00:01"  # fixed, locally administered: partitions send frames here to drop them
_HOST_IF = "eth0"
NAT_SUBNET = "192.168.1.0/24"
"""Every home network behind an :meth:`NetLab.add_nat_host` router uses this one, as real homes do."""
_QUEUE = ("latency", "50ms")  # tbf's queue holds at most 50 ms of traffic at the link's rate; more is dropped

Rate = str | int | float


class NetLabError(RuntimeError):
    """A lab command failed; the message names the command and what it printed."""


def parse_rate(rate: Rate) -> int:
    """Bits per second from ``20mbit``-style strings (tc's units) or a number of bits per second."""
    if isinstance(rate, int | float):
        return int(rate)
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-z]*)\s*", rate.lower())
    if not match or match.group(2) not in {*_UNITS, ""}:
        raise ValueError(f"bad rate {rate!r}: use e.g. 500kbit, 20mbit, 1gbit")
    return int(float(match.group(1)) * _UNITS.get(match.group(2), 1))


def sh(
    args: Sequence[str], timeout: float = CMD_TIMEOUT_S, check: bool = True, input_text: str | None = None
) -> str:
    """Run a command with a timeout; return stdout, or raise NetLabError with its stderr."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, input=input_text)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetLabError(f"{' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetLabError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@functools.cache
def unavailable_reason() -> str | None:
    """None if labs can be built here, else why not (for ``pytest.skip``). Probes once per process."""
    what = "requires root and iproute2 (ip, tc) with network-namespace support"
    if os.geteuid() != 0:
        return f"{what}: not running as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{what}: {', '.join(missing)} not found on PATH"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        sh(["ip", "netns", "add", probe])
        _ip(probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb")
        _set_tbf(probe, "pa", "1mbit", None)
    except NetLabError as exc:
        return f"{what}: {exc}"
    finally:
        sh(["ip", "netns", "del", probe], check=False)
    return None


def nat_unavailable_reason() -> str | None:
    """None if :meth:`NetLab.add_nat_host` can work here, else why not (it also needs nftables)."""
    if (reason := unavailable_reason()) is not None:
        return reason
    if shutil.which("nft") is None:
        return "requires nftables (nft) for the home routers; scripts/test_tools.sh installs it as root"
    return None


def root_available() -> bool:
    return unavailable_reason() is None


def _ip(netns: str, *args: str, check: bool = True) -> str:
    return sh(["ip", "-n", netns, *args], check=check)


def _tc(netns: str, *args: str, check: bool = True) -> str:
    return sh(["tc", "-n", netns, *args], check=check)


def _sysctl(netns: str, setting: str) -> None:
    sh(["ip", "netns", "exec", netns, "sysctl", "-q", "-w", setting])


def _helper(*args: str) -> list[str]:
    """argv running the socket helpers (``_serve``/``_client``, testbed/_sockets.py) with this
    interpreter, isolated (``-I``): they need nothing but the standard library."""
    return [sys.executable, "-I", str(Path(__file__).resolve().with_name("_sockets.py")), *args]


@dataclass
class Host:
    """One emulated machine: a network namespace with ``lo`` and ``eth0`` (``ip``) on the lab bridge."""

    index: int
    netns: str
    ip: str
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def maddr(self, port: int = 0) -> str:
        """The multiaddr to listen on in this host (``--host-maddrs``); port 0 picks a free one."""
        return f"/ip4/{self.ip}/tcp/{port}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host (for callers that spawn processes themselves)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], timeout: float = 60.0, check: bool = True) -> str:
        """Run to completion inside this host; return stdout."""
        return sh(self.command(argv), timeout=timeout, check=check)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start a long-running process inside this host, in its own session; the lab kills it on close."""
        proc = subprocess.Popen(self.command(argv), start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def stop_processes(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process group started by :meth:`popen`, SIGKILL after ``grace_s``."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.processes if p.poll() is None]
            for proc in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            for proc in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=wait_s)


class NetLab:
    """N hosts, each a namespace with a veth into one bridge (in its own namespace), shaped with ``tbf``.

    ``rate`` limits both directions of every host's link (upload: tbf on the host's ``eth0``;
    download: tbf on the bridge's port towards the host). ``None`` leaves links unshaped.
    """

    def __init__(
        self,
        hosts: int = 3,
        rate: Rate | None = None,
        burst: int | None = None,
        prefix: str | None = None,
        subnet: str = SUBNET,
    ) -> None:
        network = ipaddress.ip_network(subnet)
        if not 1 <= hosts <= min(64, network.num_addresses - 2):
            raise ValueError(f"hosts must be 1..64 and fit in {subnet}, got {hosts}")
        self.prefix = prefix or f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.bridge_netns = f"{self.prefix}-br"
        addresses = list(network.hosts())
        self.prefixlen = network.prefixlen
        self.hosts = [Host(i, f"{self.prefix}-h{i}", str(addresses[i])) for i in range(hosts)]
        self.rate, self.burst = rate, burst
        self.nat_hosts: list[Host] = []
        self._servers: dict[int, subprocess.Popen] = {}
        self._servers_lock = threading.Lock()
        self._closed = True

    def __enter__(self) -> NetLab:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the lab; on any failure (or Ctrl+C) tear down what was built, then re-raise."""
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        br = self.bridge_netns
        sh(["ip", "netns", "add", br])
        _sysctl(br, "net.ipv4.ip_forward=0")
        _sysctl(br, "net.ipv6.conf.default.disable_ipv6=1")
        _ip(br, "link", "add", "name", _BRIDGE, "address", _BRIDGE_MAC, "type", "bridge")
        _ip(br, "link", "set", _BRIDGE, "up")
        for host in self.hosts:
            self._add_host(host)
            self.shape(host.index, self.rate, burst=self.burst)

    def _add_host(self, host: Host) -> None:
        br, ns, port = self.bridge_netns, host.netns, f"p{host.index}"
        sh(["ip", "netns", "add", ns])
        _ip(br, "link", "add", "name", port, "type", "veth", "peer", "name", _HOST_IF, "netns", ns)
        _ip(br, "link", "set", port, "master", _BRIDGE, "up")
        _sysctl(ns, f"net.ipv6.conf.{_HOST_IF}.disable_ipv6=1")
        _ip(ns, "addr", "add", f"{host.ip}/{self.prefixlen}", "dev", _HOST_IF)
        _ip(ns, "link", "set", _HOST_IF, "up")
        _ip(ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill every process in the lab's namespaces and delete them (idempotent, never raises)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for host in self.nat_hosts + self.hosts:
            host.stop_processes()
        for proc in self._servers.values():
            if proc.stdout is not None:
                proc.stdout.close()
        remove_labs(f"{self.prefix}-", owner_alive_ok=True)

    def shape(
        self,
        host: int,
        rate: Rate | None = None,
        *,
        up: Rate | None = None,
        down: Rate | None = None,
        burst: int | None = None,
    ) -> None:
        """Set host ``host``'s link: ``up``/``down`` default to ``rate``; None in a direction = unshaped."""
        up, down = up or rate, down or rate
        _set_tbf(self.hosts[host].netns, _HOST_IF, up, burst)
        _set_tbf(self.bridge_netns, f"p{host}", down, burst)

    def partition(self, group_a: Sequence[int], group_b: Sequence[int]) -> None:
        """Silently drop all IPv4 traffic between the two groups (each direction), until :meth:`heal`.

        Each host gets a permanent neighbour entry sending the other group's addresses to the
        bridge's own MAC; the bridge namespace has no address and no forwarding, so it drops them
        without an ICMP answer, like a broken path on the internet. Hosts outside both groups keep
        talking to everyone.
        """
        for mine, theirs in ((group_a, group_b), (group_b, group_a)):
            for i in mine:
                for j in theirs:
                    neigh = (self.hosts[j].ip, "lladdr", _BRIDGE_MAC, "dev", _HOST_IF, "nud", "permanent")
                    _ip(self.hosts[i].netns, "neigh", "replace", *neigh)

    def add_nat_host(self, router: int) -> Host:
        """A machine in a home network behind host ``router``, which becomes its NAT router.

        The new host (its own namespace) has address ``.2`` of :data:`NAT_SUBNET` and a default route
        through the router (``.1``). The router masquerades what the home network sends out (nftables),
        and forwards back only replies to connections opened from inside: like a home router with
        no port forward, nothing outside can open a connection to the new host. Processes in it reach
        the lab with the router's address and the router's shaped link.
        """
        base = ipaddress.ip_network(NAT_SUBNET)
        gateway, address = (str(a) for a in list(base.hosts())[:2])
        outer = self.hosts[router].netns
        ns = f"{self.prefix}-nat{router}"
        sh(["ip", "netns", "add", ns])
        host = Host(router, ns, address)
        self.nat_hosts.append(host)
        _ip(outer, "link", "add", "name", "lan0", "type", "veth", "peer", "name", _HOST_IF, "netns", ns)
        _ip(outer, "addr", "add", f"{gateway}/{base.prefixlen}", "dev", "lan0")
        _ip(outer, "link", "set", "lan0", "up")
        _sysctl(ns, f"net.ipv6.conf.{_HOST_IF}.disable_ipv6=1")
        _ip(ns, "addr", "add", f"{address}/{base.prefixlen}", "dev", _HOST_IF)
        _ip(ns, "link", "set", _HOST_IF, "up")
        _ip(ns, "link", "set", "lo", "up")
        _ip(ns, "route", "add", "default", "via", gateway)
        _sysctl(outer, "net.ipv4.ip_forward=1")
        sh(["ip", "netns", "exec", outer, "nft", "-f", "-"], input_text=_HOME_ROUTER_RULES)
        return host

    def heal(self) -> None:
        """Undo every :meth:`partition`."""
        for host in self.hosts:
            _ip(host.netns, "neigh", "flush", "dev", _HOST_IF, "nud", "permanent")

    def server(self, host: int) -> int:
        """Start (once) the echo/sink server (testbed/_sockets.py) in ``host``; return its port."""
        with self._servers_lock:
            if host not in self._servers:
                self._servers[host] = self._start_server(host)
        return SERVER_PORT

    def _start_server(self, host: int) -> subprocess.Popen:
        argv = _helper("_serve", "--port", str(SERVER_PORT))
        proc = self.hosts[host].popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], 15.0)[0] or proc.stdout.readline().strip() != "ready":
            raise NetLabError(f"test server in host {host} did not start")
        return proc

    def probe(
        self, src: int, dst: int, mode: str, nbytes: int = 64, timeout: float = 30.0, check: bool = True
    ) -> dict:
        """Run the socket client in ``src`` against the server in ``dst``; return its JSON result."""
        port = self.server(dst)
        argv = _helper("_client", self.hosts[dst].ip, str(port), mode, str(nbytes), str(timeout))
        result = json.loads(self.hosts[src].run(argv, timeout=timeout + 10))
        if check and not result["ok"]:
            raise NetLabError(f"{mode} from host {src} to host {dst} failed: {result['error']}")
        return result

    def reachable(self, src: int, dst: int, timeout: float = 2.0) -> bool:
        """Whether a TCP echo from ``src`` to ``dst`` completes within ``timeout``."""
        return bool(self.probe(src, dst, "echo", timeout=timeout, check=False)["ok"])

    def rtt_ms(self, src: int, dst: int) -> float:
        """Median round-trip time of small TCP echoes, in milliseconds."""
        return float(self.probe(src, dst, "echo", timeout=10.0)["rtt_ms"])

    def throughput(self, src: int, dst: int, nbytes: int = 4_000_000, timeout: float = 60.0) -> float:
        """Bits per second from ``src`` to ``dst``, timed by the receiver from first to last byte."""
        result = self.probe(src, dst, "sink", nbytes=nbytes, timeout=timeout)
        if result["seconds"] <= 0:
            raise NetLabError(f"{nbytes} bytes arrived in one chunk, too few to time; send more")
        return result["bytes"] * 8 / result["seconds"]


_HOME_ROUTER_RULES = """
table ip home {
    chain outbound {
        type nat hook postrouting priority 100;
        oifname "eth0" masquerade
    }
    chain forwarding {
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan0" accept
    }
}
"""


def _set_tbf(netns: str, dev: str, rate: Rate | None, burst: int | None) -> None:
    _tc(netns, "qdisc", "del", "dev", dev, "root", check=False)
    if rate is None:
        return
    bits = parse_rate(rate)
    burst = burst or max(16 * 1024, bits // 8 // 250)  # 4 ms of traffic, never under ~10 MTUs
    _tc(netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits}bit", "burst", str(burst), *_QUEUE)


def list_labs(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix``."""
    listing = sh(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(prefix))


def _owner_alive(netns: str) -> bool:
    match = re.match(rf"{re.escape(PREFIX)}(\d+)-", netns)
    return match is not None and Path(f"/proc/{match.group(1)}").exists()


def remove_labs(prefix: str = PREFIX, owner_alive_ok: bool = False) -> list[str]:
    """SIGKILL the processes in matching namespaces and delete them; return their names.

    Unless ``owner_alive_ok``, namespaces whose creating process still runs are left alone, so one
    run's cleanup never breaks a lab another run is using.
    """
    removed = []
    for netns in list_labs(prefix):
        if not owner_alive_ok and _owner_alive(netns):
            continue
        for pid in sh(["ip", "netns", "pids", netns], check=False).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        sh(["ip", "netns", "del", netns], check=False)
        removed.append(netns)
    return removed
