"""Two trainers, each behind its own home router (testbed/netlab.py ``add_nat_host``), beside a public
bootstrap: neither can be dialled, and both train together through the bootstrap, which relays.

Each trainer is told it may be behind NAT (``--behind-nat``): the dial-back check finds it
unreachable, and it announces a ``/p2p-circuit`` address through the bootstrap instead of going into
client mode; the bootstrap forwards streams to it (swarm/p2p/_forward.py). Asserted: both say so
(record ``reachability: relay``), each completes pseudo-gradient exchanges with the other (the only
other trainer), each counted relayed stream bytes in both directions (summary ``relayed``), and the
bootstrap reports what it carried. The home routers forward nothing in, so every one of those
exchanges crossed the relay. The exchanges are fp32, about 270 KiB each way: libp2p's circuit relay in
the bundled p2pd resets a connection after 128 KiB.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peers.bootstrap import JOIN_LINE_PREFIX
from testbed.netlab import NetLab, nat_unavailable_reason
from tests._processes import PeerProcess, heavy_scenario, swarm_cli, terminate_and_wait, wait_until
from tests.workers.tiny import ONE_THREAD, UNLIMITED, cli_sets, tiny

pytestmark = [
    pytest.mark.multipeer,
    pytest.mark.skipif(nat_unavailable_reason() is not None, reason=nat_unavailable_reason() or ""),
]

OVERRIDES = tiny(
    UNLIMITED,
    "averaging.sync_every_steps=10",
    "model.n_embd=64",  # about 70K parameters: 270 KiB per fp32 exchange
    "compression.codec=fp32",
    # until the other trainer has found itself unreachable, dials to it fail: keep bans short
    "averaging.ban_base_s=1",
    "averaging.ban_max_s=5",
)
CIRCUIT_LIMIT_KIB = 128
"""Where the bundled p2pd's circuit relay resets a connection (docs/hosting.md)."""
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
@pytest.mark.timeout(600)
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
            args = ["join", "--initial-peers", maddr, "--behind-nat", *where]
            sets = cli_sets(OVERRIDES)
            trainers.append(spawn(home.command(swarm_cli(*args, *sets)), env=ONE_THREAD))
        ids = []
        for trainer in trainers:
            joined = trainer.wait_for_line(lambda text: text.startswith("peer ") and " joined " in text, 240)
            ids.append(joined.split()[1])
            n_params = int(joined.split(" parameters")[0].rsplit(" ", 1)[1].replace(",", ""))
            relayed = trainer.wait_for_line(lambda text: "now reachable through relays" in text, 120)
            assert f"/p2p/{ids[-1]}" in relayed and "/p2p-circuit/" in relayed, relayed
        assert "no peer could dial this peer back" in trainers[0].output()

        def exchanged() -> bool:
            return all(len(_ok_syncs(t)) >= EXCHANGES for t in trainers)

        wait_until(exchanged, 300, f"{EXCHANGES} exchanges by each trainer through the relay", 2.0)
        for trainer, other in ((trainers[0], ids[1]), (trainers[1], ids[0])):
            syncs = _ok_syncs(trainer)
            assert {partner for partner, _ in syncs} == {other[-8:]}, syncs  # the boot trains nothing
            exchange_kib = n_params * 4 / 1024  # one fp32 pseudo-gradient, without frames
            assert exchange_kib > CIRCUIT_LIMIT_KIB
            # the other's whole model crossed (later exchanges may go relative to a base, and be small)
            assert any(kib > exchange_kib for _, kib in syncs), syncs
        for trainer in trainers:
            assert terminate_and_wait(trainer, timeout=60) == 0
        assert terminate_and_wait(boot, timeout=60) == 0
        carried = boot.wait_for_line(lambda text: text.startswith("bootstrap: relayed "), timeout=5)
        assert int(carried.split()[2]) >= 2 * EXCHANGES, carried
        for summary in summaries:
            numbers = json.loads(summary.read_text())
            assert numbers["reachability"] == "relay"
            assert numbers["exchanges_ok"] >= EXCHANGES
            relayed = numbers["relayed"]
            print(f"{summary.name}: exchanges_ok {numbers['exchanges_ok']}, relayed {relayed}")
            assert relayed["streams"] >= EXCHANGES
            least = EXCHANGES * exchange_kib * 1024
            assert relayed["sent"] > least and relayed["received"] > least, relayed
