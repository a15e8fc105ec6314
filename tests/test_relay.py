"""Two trainers, each behind its own home router (scripts/netlab.py ``add_nat_host``), beside a public
bootstrap: neither can be dialled, and both train together through the bootstrap's circuit relay.

Each trainer is told it is behind NAT (``network.behind_nat``): its p2p daemon reserves a slot on the
bootstrap (p2pd's trusted relay: the initial peer), the dial-back check finds it unreachable, and it
announces its ``/p2p-circuit`` address instead of going into client mode. Asserted: both say so
(record ``reachability: relay``), each completes pseudo-gradient exchanges with the other (the only
other trainer), and each counted relayed stream bytes in both directions (summary ``relayed``). The
home routers forward nothing in, so every one of those exchanges crossed the relay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peers.bootstrap import JOIN_LINE_PREFIX
from scripts.netlab import NetLab, nat_unavailable_reason
from tests._processes import PeerProcess, heavy_scenario, swarm_cli, terminate_and_wait, wait_until
from tests.workers.tiny import ONE_THREAD, UNLIMITED, cli_sets, tiny

pytestmark = [
    pytest.mark.multipeer,
    pytest.mark.skipif(nat_unavailable_reason() is not None, reason=nat_unavailable_reason() or ""),
]

OVERRIDES = tiny(
    UNLIMITED,
    "averaging.sync_every_steps=10",
    # until p2pd has reserved the relay slot (about 3 minutes after start) dials fail: keep bans short
    "averaging.ban_base_s=1",
    "averaging.ban_max_s=5",
)
EXCHANGES = 2
"""Pseudo-gradient exchanges each trainer completes with the other, at least."""


def _ok_syncs(process: PeerProcess) -> list[tuple[str, float]]:
    """(partner's last 8 characters, KiB received) of the ``ok`` syncs printed so far."""
    syncs = []
    for line in process.output().splitlines():
        words = line.split()
        if len(words) > 20 and words[0] == "round" and words[12] == "sync" and words[13] == "ok":
            syncs.append((words[15], float(words[20])))
    return syncs


@heavy_scenario
@pytest.mark.timeout(900)  # the relay reservation alone takes p2pd about 3 minutes
def test_two_trainers_behind_home_routers_train_through_the_bootstrap_relay(spawn, tmp_path: Path) -> None:
    with NetLab(hosts=3) as lab:
        homes = [lab.add_nat_host(1), lab.add_nat_host(2)]
        listen = ["--host-maddrs", lab.hosts[0].maddr()]
        boot_argv = swarm_cli("bootstrap", *listen, *cli_sets(OVERRIDES))
        boot = spawn(lab.hosts[0].command(boot_argv), env=ONE_THREAD)
        line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=180)
        maddr = line[len(JOIN_LINE_PREFIX) :].strip()
        summaries = [tmp_path / f"home{i}.json" for i in range(2)]
        trainers = []
        for home, summary in zip(homes, summaries, strict=True):
            where = ["--host-maddrs", home.maddr(), "--summary", str(summary)]
            args = ["join", "--initial-peers", maddr, *where]
            sets = cli_sets([*OVERRIDES, "network.behind_nat=true"])
            trainers.append(spawn(home.command(swarm_cli(*args, *sets)), env=ONE_THREAD))
        ids = []
        for trainer in trainers:
            joined = trainer.wait_for_line(lambda text: text.startswith("peer ") and " joined " in text, 240)
            ids.append(joined.split()[1])
            relayed = trainer.wait_for_line(lambda text: "now reachable through a circuit relay" in text, 120)
            assert f"/p2p/{ids[-1]}" in relayed and "/p2p-circuit/" in relayed, relayed
        assert "no peer could dial this peer back" in trainers[0].output()

        def exchanged() -> bool:
            return all(len(_ok_syncs(t)) >= EXCHANGES for t in trainers)

        wait_until(exchanged, 480, f"{EXCHANGES} exchanges by each trainer through the relay", 2.0)
        for trainer, other in ((trainers[0], ids[1]), (trainers[1], ids[0])):
            syncs = _ok_syncs(trainer)
            assert {partner for partner, _ in syncs} == {other[-8:]}, syncs  # the boot trains nothing
            assert all(kib > 0 for _, kib in syncs), syncs  # each received the other's pseudo-gradient
        for trainer in trainers:
            assert terminate_and_wait(trainer, timeout=60) == 0
        assert terminate_and_wait(boot, timeout=60) == 0
        for summary in summaries:
            numbers = json.loads(summary.read_text())
            assert numbers["reachability"] == "relay"
            assert numbers["exchanges_ok"] >= EXCHANGES
            relayed = numbers["relayed"]
            print(f"{summary.name}: exchanges_ok {numbers['exchanges_ok']}, relayed {relayed}")
            # what one exchange carries each way is well over 1 KiB even for the tiny model (int8)
            assert relayed["streams"] >= EXCHANGES
            assert relayed["sent"] > 1024 * EXCHANGES and relayed["received"] > 1024 * EXCHANGES, relayed
