"""The emulated-internet testbed (testbed/netlab.py): reachability, shaping, partitions, teardown, peers."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from peers.bootstrap import JOIN_LINE_PREFIX
from testbed import netlab
from testbed.netlab import NetLab, list_labs, nat_unavailable_reason, parse_rate, unavailable_reason
from tests._processes import swarm_cli, terminate_and_wait
from tests.workers.tiny import cli_sets, tiny

needs_lab = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
needs_nat = pytest.mark.skipif(nat_unavailable_reason() is not None, reason=nat_unavailable_reason() or "")
TINY = cli_sets(tiny())


def _root_links() -> list[str]:
    return sorted(line.split(":")[1].strip() for line in netlab.sh(["ip", "-o", "link"]).splitlines())


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    with NetLab(hosts=3, rate="20mbit") as built:
        yield built


def test_parse_rate() -> None:
    assert parse_rate("20mbit") == 20_000_000
    assert parse_rate("1.5gbit") == 1_500_000_000
    assert parse_rate("500kbit") == 500_000
    assert parse_rate(1234) == 1234
    with pytest.raises(ValueError, match="bad rate"):
        parse_rate("fast")


def test_unavailable_reason_names_what_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(netlab.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netlab.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    reason = unavailable_reason.__wrapped__()
    assert reason.startswith("requires root and iproute2 (ip, tc) with network-namespace support:")
    assert "tc not found" in reason


@needs_lab
def test_hosts_reach_each_other_by_ip(lab: NetLab) -> None:
    assert [h.ip for h in lab.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    for src in range(3):
        for dst in range(3):
            if src != dst:
                assert lab.reachable(src, dst), (src, dst)
    assert lab.hosts[0].run(["ip", "-o", "addr", "show", "lo"]).count("127.0.0.1") == 1


@needs_lab
def test_hosts_have_no_route_out(lab: NetLab) -> None:
    routes = lab.hosts[0].run(["ip", "route", "show"]).strip().splitlines()
    assert routes == ["10.77.0.0/24 dev eth0 proto kernel scope link src 10.77.0.1"]


def _shaped_rates(lab: NetLab, host: int) -> tuple[float, float]:
    """The token-bucket rates (bits/s) tc enforces on ``host``'s link: (up, down)."""

    def rate(netns: str, dev: str) -> float:
        [qdisc] = json.loads(
            netlab.sh(["ip", "netns", "exec", netns, "tc", "-j", "qdisc", "show", "dev", dev])
        )
        assert qdisc["kind"] == "tbf", qdisc
        return qdisc["options"]["rate"] * 8.0  # tc reports bytes per second

    return rate(lab.hosts[host].netns, "eth0"), rate(lab.bridge_netns, f"p{host}")


@needs_lab
def test_shaped_link_is_not_faster_than_its_rate(lab: NetLab) -> None:
    # what the kernel enforces is exactly what was asked for, in both directions ...
    assert _shaped_rates(lab, 0) == (20e6, 20e6)
    # ... and a transfer never beats it (a busy machine can only make it slower: no lower bound here)
    bits = lab.throughput(0, 1, nbytes=4_000_000)
    assert bits <= 1.2 * 20e6, bits / 1e6
    lab.shape(2, up="8mbit", down="20mbit")
    try:
        assert _shaped_rates(lab, 2) == (8e6, 20e6)
        bits = lab.throughput(2, 0, nbytes=2_000_000)
        assert bits <= 1.2 * 8e6, bits / 1e6
    finally:
        lab.shape(2, "20mbit")


@needs_lab
def test_partition_blocks_traffic_and_heal_restores_it(lab: NetLab) -> None:
    lab.partition([0], [1])
    try:
        assert not lab.reachable(0, 1, timeout=1.5)
        assert not lab.reachable(1, 0, timeout=1.5)
        assert lab.reachable(0, 2) and lab.reachable(2, 1)
    finally:
        lab.heal()
    assert lab.reachable(0, 1) and lab.reachable(1, 0)


def _assert_gone(built: NetLab, links_before: list[str], proc: subprocess.Popen) -> None:
    assert list_labs(built.prefix) == []
    assert not any(built.prefix in line for line in netlab.sh(["ip", "netns", "list"]).splitlines())
    assert _root_links() == links_before
    assert proc.poll() is not None


@needs_lab
def test_teardown_removes_namespaces_links_and_processes() -> None:
    links_before = _root_links()
    with NetLab(hosts=2) as built:
        assert len(list_labs(built.prefix)) == 3
        proc = built.hosts[1].popen(["sleep", "300"])
        assert _root_links() == links_before
    _assert_gone(built, links_before, proc)


@needs_lab
def test_teardown_also_when_the_body_raises() -> None:
    links_before = _root_links()
    built = NetLab(hosts=2, rate="10mbit")
    with pytest.raises(RuntimeError, match="boom"), built:
        proc = built.hosts[0].popen(["sleep", "300"])
        raise RuntimeError("boom")
    _assert_gone(built, links_before, proc)


@needs_lab
@pytest.mark.multipeer
def test_two_peers_in_two_hosts_join(spawn, lab: NetLab) -> None:
    boot_host, join_host = lab.hosts[0], lab.hosts[1]
    listen = ["--host-maddrs", f"/ip4/{boot_host.ip}/tcp/0"]
    boot = spawn(boot_host.command(swarm_cli("bootstrap", *listen, *TINY)))
    line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=90)
    maddr = line[len(JOIN_LINE_PREFIX) :]
    assert maddr.startswith(f"/ip4/{boot_host.ip}/tcp/")

    joiner_listen = ["--host-maddrs", f"/ip4/{join_host.ip}/tcp/0"]
    joiner = spawn(join_host.command(swarm_cli("join", "--initial-peers", maddr, *joiner_listen, *TINY)))
    joiner.wait_for_line(lambda text: text.startswith("peer ") and "joined run" in text, timeout=90)
    assert terminate_and_wait(joiner, timeout=15) == 0
    assert terminate_and_wait(boot, timeout=15) == 0


def _echo(host: netlab.Host, ip: str, port: int) -> dict:
    return json.loads(host.run(netlab._helper("_client", ip, str(port), "echo", "64", "3")))


@needs_nat
def test_a_host_behind_a_home_router_dials_out_and_nobody_dials_in() -> None:
    with NetLab(hosts=2) as built:
        home = built.add_nat_host(1)
        assert home.ip == "192.168.1.2"
        # out: host 0 has no route to 192.168.1.0/24, so its replies arrive only if the router
        # rewrote the source to its own address (masquerade)
        assert _echo(home, built.hosts[0].ip, built.server(0))["ok"]
        inside = home.popen(
            netlab._helper("_serve", "--port", "5300"),
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert inside.stdout.readline().strip() == "ready"
        assert _echo(home, "127.0.0.1", 5300)["ok"]  # the server in the home network does listen...
        for ip in (built.hosts[1].ip, home.ip):  # ...but neither the router's address nor its own reach it
            refused = _echo(built.hosts[0], ip, 5300)
            assert not refused["ok"], (ip, refused)
        # not even for a neighbour that routes the home network through the router: it forwards in
        # only replies to connections opened from inside
        built.hosts[0].run(["ip", "route", "add", "192.168.1.0/24", "via", built.hosts[1].ip])
        assert not _echo(built.hosts[0], home.ip, 5300)["ok"]
    assert list_labs(built.prefix) == []
