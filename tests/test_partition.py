"""Partitions: a swarm split 2|3 by the namespace testbed keeps training in both halves, then heals.

Five hosts (scripts/netlab.py), a trainer in each and the bootstrap in host 0. After every trainer has
synced, ``lab.partition([0, 1], [2, 3, 4])`` cuts all traffic between the halves (silently, like a
broken internet path): the half without the bootstrap is a real partition, not one that still reaches
the swarm's entry point. Asserted while split: every trainer keeps stepping and completes exchanges,
all with partners of its own half. After ``lab.heal()``: trainers exchange across the former cut
again, and every trainer's drift (the relative distance to its partner's parameters, measured at each
full-parameter exchange, in the last field of the per-sync line) ends under ``averaging.max_drift``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from peers.bootstrap import JOIN_LINE_PREFIX
from scripts.netlab import NetLab, unavailable_reason
from tests._processes import PeerProcess, swarm_cli, terminate_and_wait, wait_until

pytestmark = [
    pytest.mark.multipeer,
    pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or ""),
]

HALVES = ([0, 1], [2, 3, 4])
MAX_DRIFT = 0.15
PARAM_SYNC_EVERY = 3
SPLIT_S = 20.0
OVERRIDES = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "train.batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.max_steps=100000",
    "averaging.sync_every_steps=10",
    f"averaging.param_sync_every={PARAM_SYNC_EVERY}",
    f"averaging.max_drift={MAX_DRIFT}",
    "averaging.exchange_timeout_s=5",
    "averaging.chunk_timeout_s=5",
    "network.record_interval_s=1",
    "network.record_ttl_s=4",
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # six processes on two cores


def _sets() -> list[str]:
    return [item for override in OVERRIDES for item in ("--set", override)]


class Trainer:
    def __init__(self, spawn, lab: NetLab, index: int, maddr: str):
        host = lab.hosts[index]
        args = ["join", "--initial-peers", maddr, "--host-maddrs", host.maddr(), "--public-name", f"h{index}"]
        self.process: PeerProcess = spawn(host.command(swarm_cli(*args, *_sets())), env=ONE_THREAD)
        self.index = index
        self.peer_id = ""

    def wait_joined(self, timeout: float) -> None:
        line = self.process.wait_for_line(
            lambda text: text.startswith("peer ") and "joined run" in text, timeout
        )
        self.peer_id = line.split()[1]

    def syncs(self, since: int = 0) -> list[dict]:
        """The per-sync lines printed after the ``since``-th line, parsed."""
        found = []
        lines = self.process.output().splitlines()[since:]
        for line in lines:
            words = line.split()
            if len(words) > 16 and words[0] == "round" and words[12] == "sync":
                drift = None if words[-1] == "-" else float(words[-1])
                found.append(
                    {"step": int(words[3]), "outcome": words[13], "partner": words[15], "drift": drift}
                )
        return found

    def mark(self) -> int:
        return len(self.process.output().splitlines())


@pytest.fixture
def lab() -> Iterator[NetLab]:
    with NetLab(hosts=5) as built:
        yield built


def _ok_partners(trainer: Trainer, since: int) -> set[str]:
    return {s["partner"] for s in trainer.syncs(since) if s["outcome"] == "ok"}


def test_both_halves_train_through_a_partition_and_drift_recovers_after_healing(spawn, lab: NetLab) -> None:
    started = time.monotonic()
    boot = spawn(
        lab.hosts[0].command(swarm_cli("bootstrap", "--host-maddrs", lab.hosts[0].maddr(), *_sets()))
    )
    line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=90)
    maddr = line[len(JOIN_LINE_PREFIX) :].strip()
    trainers = [Trainer(spawn, lab, index, maddr) for index in range(5)]
    for trainer in trainers:
        trainer.wait_joined(timeout=90)
    wait_until(lambda: all(_ok_partners(t, 0) for t in trainers), 60, "every trainer to sync once")
    short = {t.peer_id[-8:]: t.index for t in trainers}
    half_of = {index: h for h, half in enumerate(HALVES) for index in half}

    lab.partition(*HALVES)
    split_at = time.monotonic()
    marks = [t.mark() for t in trainers]
    # an exchange already under way when the cut came may still finish: judge from the second sync on
    wait_until(
        lambda: all(len(t.syncs(m)) >= 2 for t, m in zip(trainers, marks, strict=True)),
        60,
        "syncs after the cut",
    )
    marks = [t.mark() for t in trainers]
    steps_at_split = [t.syncs()[-1]["step"] for t in trainers]
    wait_until(
        lambda: (
            all(_ok_partners(t, m) for t, m in zip(trainers, marks, strict=True))
            and time.monotonic() - split_at > SPLIT_S
        ),
        60,
        "exchanges inside each half",
    )
    for trainer, mark, steps in zip(trainers, marks, steps_at_split, strict=True):
        partners = {short.get(p) for p in _ok_partners(trainer, mark)}
        assert partners and all(p is not None and half_of[p] == half_of[trainer.index] for p in partners), (
            trainer.index,
            partners,
        )
        assert trainer.syncs()[-1]["step"] > steps, f"trainer {trainer.index} stopped stepping while split"

    lab.heal()
    healed_at = time.monotonic()
    marks = [t.mark() for t in trainers]

    def rejoined() -> bool:
        crossed = any(
            half_of[short[p]] != half_of[t.index]
            for t, m in zip(trainers, marks, strict=True)
            for p in _ok_partners(t, m)
            if p in short
        )
        # several full-parameter exchanges since healing, so the drift is fresh, not from before
        return crossed and all(
            len(s := t.syncs(m)) >= 2 * PARAM_SYNC_EVERY
            and s[-1]["drift"] is not None
            and s[-1]["drift"] < MAX_DRIFT
            for t, m in zip(trainers, marks, strict=True)
        )

    recovered_s = wait_until(rejoined, 60, "exchanges across the healed cut and drift under max_drift")
    drifts = [max((s["drift"] or 0.0) for s in t.syncs(m)) for t, m in zip(trainers, marks, strict=True)]
    print(
        f"split {healed_at - split_at:.0f}s; after healing: cross-half exchange, drift < {MAX_DRIFT} in "
        f"{recovered_s:.0f}s, peak drifts {drifts}; total {time.monotonic() - started:.0f}s"
    )
    for trainer in trainers:
        assert terminate_and_wait(trainer.process, timeout=15) == 0
    assert terminate_and_wait(boot, timeout=15) == 0
