"""Malicious peers: a 5-trainer swarm with two attackers still trains, and both attackers are banned.

Two swarms (tests/workers/malicious.py, one process per trainer) train the same tiny model side by
side: one of five trainers with two attackers, peer 0 sending its pseudo-gradients scaled x100 and
peer 1 sending standard normal noise instead of its own, and a clean one of the three honest peers
(2-4) alone. The honest peers' final held-out loss must stay within ``LOSS_MARGIN`` bits per byte of
the same peers' in the clean swarm (same identities, so the same data): the attackers may cost the
honest peers the exchanges they waste on them, but not their training. Bans are checked as they
happened, with the default ban times (a first ban lasts 10 s): while every peer trained, some honest
peer banned each attacker, every honest peer with more than ``clip_strikes`` hard exchanges against
the noise sender banned it (pairing is random, so a peer may meet an attacker once in 20 rounds;
docs/gossip.md, "Blame is local"), and no honest peer banned another, in either swarm: not for
its data, and not for a stream that broke on two cores shared with the rest of the suite (one
broken stream is held, not banned: docs/gossip.md, "Never a stall"). Undefended, the same attacks
take every peer to Inf/NaN (docs/gossip.md).

A last, in-process test checks that nobody can overwrite another peer's membership record (and so
its announced progress), even with a well-formed record signed by a key of its own.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm import NetworkOptions, NodeInfo, PeerRecord, SwarmNode
from swarm.config import AveragingSection
from swarm.membership import record_key
from swarm.network import ensure_identity
from tests._processes import heavy_scenario, wait_until
from tests.workers.malicious import Swarm, swarms_stopped_cleanly
from tests.workers.tiny import ANCHOR_CODEC, tiny

SIZE = 5
HONEST = [2, 3, 4]
# swarm: (the identities of its peers, {peer index in that swarm: attack})
SWARMS = {"clean": (HONEST, {}), "attacked": (list(range(SIZE)), {0: "scaled", 1: "random"})}
STEPS = 100  # at 80, clean swarms of this model still end either side of the unigram plateau
OVERRIDES = tiny(
    "train.eval_batches=8", f"train.max_steps={STEPS}", "averaging.sync_every_steps=5", *ANCHOR_CODEC
)
LOSS_MARGIN = 0.5  # bits per byte: clean-run noise at this size and length, see docs/gossip.md
CLIP_STRIKES = AveragingSection().clip_strikes  # hard exchanges that ban (the runs keep the default)


@pytest.fixture
def swarms() -> Iterator[list[Swarm]]:
    """Swarms started by the test, stopped at teardown and checked for leaks."""
    with swarms_stopped_cleanly() as started:
        yield started


def _run(swarms: list[Swarm], tmp_path: Path) -> dict[str, tuple[Swarm, list[dict], list[dict[str, Any]]]]:
    """Train the clean and the attacked swarms side by side; return each one's swarm, peer summaries
    and what each peer reported (when it trained, the bans it pronounced)."""
    identities = [str(ensure_identity(tmp_path / f"peer-{i}.key")) for i in range(SIZE)]
    runs = {
        name: Swarm([f"run.run_id=malicious-{name}", *OVERRIDES], attacks, [identities[i] for i in members])
        for name, (members, attacks) in SWARMS.items()
    }
    swarms.extend(runs.values())
    for step in (Swarm.start_first, Swarm.start_rest, Swarm.wait_ready):  # all swarms start in parallel
        for swarm in runs.values():
            step(swarm)
    paths = {}
    for name, swarm in runs.items():
        (tmp_path / name).mkdir()
        paths[name] = swarm.go(tmp_path / name)
    reports = {name: swarm.wait_done(timeout=300) for name, swarm in runs.items()}
    return {
        name: (swarm, [json.loads(p.read_text()) for p in paths[name]], reports[name])
        for name, swarm in runs.items()
    }


def _honest(name: str) -> list[int]:
    """The indices, in swarm ``name``, of its honest peers."""
    members, attacks = SWARMS[name]
    return [i for i in range(len(members)) if i not in attacks]


def _bans_while_all_trained(reports: list[dict[str, Any]], index: int) -> list[tuple[str, str]]:
    """(banned peer, reason) of the bans peer ``index`` pronounced before any peer of its swarm stopped
    training (a partner that finished and left is not banned for it either, but the end of a run is not
    what this test is about)."""
    first_done = min(report["finished"] for report in reports)
    return [(peer, reason) for at, peer, reason in reports[index]["bans"] if at < first_done]


def _suspicions_while_all_trained(reports: list[dict[str, Any]], index: int, peer: str) -> int:
    """How many hard exchanges with ``peer`` peer ``index`` counted against it before any peer of its
    swarm stopped training."""
    first_done = min(report["finished"] for report in reports)
    return sum(1 for at, suspect in reports[index]["suspicions"] if suspect == peer and at < first_done)


@heavy_scenario
@pytest.mark.multipeer
@pytest.mark.timeout(480)
def test_honest_peers_train_through_an_attacker_and_ban_it(swarms, tmp_path) -> None:
    started = time.monotonic()
    results = _run(swarms, tmp_path)
    # the same identities, so the same data, as the attacked swarm's honest peers
    clean = statistics.fmean(peer["eval_loss"] for peer in results["clean"][1])
    report: dict[str, Any] = {"clean": round(clean, 3), "seconds": round(time.monotonic() - started)}
    for name, (swarm, summaries, reports) in results.items():
        attacks = SWARMS[name][1]
        attackers = {swarm.peer_ids[i]: attack for i, attack in attacks.items()}
        honest = _honest(name)
        report[name] = {
            "training_s": round(max(r["finished"] for r in reports) - min(r["started"] for r in reports)),
            "honest_loss": round(statistics.fmean(summaries[i]["eval_loss"] for i in honest), 3),
            "per_peer": [round(peer["eval_loss"], 3) for peer in summaries],
            "clipped": [summaries[i]["exchanges_clipped"] for i in honest],
            "suspect": [summaries[i]["exchanges_suspect"] for i in honest],
            "bans": {i: [(attackers.get(p, p[-6:]), r[:60]) for p, r in _bans_while_all_trained(reports, i)]
                     for i in honest},
        }  # fmt: skip
    print(report)
    for name, (swarm, _, peer_reports) in results.items():
        honest = _honest(name)
        honest_ids = {swarm.peer_ids[i] for i in honest}
        assert report[name]["honest_loss"] <= clean + LOSS_MARGIN, (name, report)
        banned_by = {}
        for i in honest:
            bans = _bans_while_all_trained(peer_reports, i)
            wrongly = [(peer, reason) for peer, reason in bans if peer in honest_ids]
            assert not wrongly, f"{name}: honest peer {i} banned honest peers: {wrongly}"
            banned_by[i] = {peer for peer, _ in bans}
        for index, attack in SWARMS[name][1].items():
            attacker = swarm.peer_ids[index]
            # Blame is local (docs/gossip.md): a peer bans on its own evidence, and pairing is random,
            # so an honest peer may meet an attacker once or never in 20 rounds. A x100 scaled update
            # is only hard when its offer is early in the attacker's round, so the swarm as a whole
            # must ban it. Noise is hard in every exchange (its norm is that of the weights, so it
            # passes validation): any honest peer with more hard exchanges against it than
            # CLIP_STRIKES across its two averagers (model exchanges with its ruined weights are hard
            # too) has two in one averager, and must have banned it.
            banners = [i for i in honest if attacker in banned_by[i]]
            assert banners, f"{name}: no honest peer banned the {attack} attacker: {report}"
            if attack == "random":
                hard = {i: _suspicions_while_all_trained(peer_reports, i, attacker) for i in honest}
                unbanned = [i for i in honest if hard[i] > CLIP_STRIKES and i not in banners]
                assert not unbanned, f"{name}: peers {unbanned} saw noise hard {hard} and kept it: {report}"


class _ForgingSigner(RSASignatureValidator):
    """Signs every record with its own key, whoever's owner marker the subkey carries, and accepts all."""

    def sign_value(self, record) -> bytes:
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)

    def validate(self, record) -> bool:
        return True


def test_a_peer_cannot_overwrite_another_peers_record_or_progress() -> None:
    """A signed, well-formed record under the honest peer's own subkey, claiming its id and huge progress."""
    status = {"state": "training", "step": 7, "samples_total": 56}
    honest = SwarmNode(NetworkOptions(), NodeInfo("forge", "ab12", "trainer"), status=lambda: status)
    maddrs = honest.visible_maddrs()
    observer = SwarmNode(NetworkOptions(initial_peers=maddrs), NodeInfo("forge", "ab12", "bootstrap"))
    signer = _ForgingSigner(RSAPrivateKey())
    forger = hivemind.DHT(initial_peers=maddrs, start=True, record_validators=[signer])
    try:
        forged = PeerRecord(
            peer_id=honest.peer_id,
            protocol_version=1,
            package_version="x",
            config_hash="ab12",
            role="trainer",
            step=10**6,
            samples_total=10**9,
        ).dict()
        later = get_dht_time() + 60  # outlives the honest record, so it would win if it were accepted
        owner = honest.signer.local_public_key
        forger.store(record_key("forge"), subkey=owner, value=forged, expiration_time=later)
        mounted = forger.get(record_key("forge"), latest=True)  # the forger's node holds it
        assert mounted is not None and mounted.value[owner].value["step"] == 10**6
        wait_until(lambda: len(observer.members()) == 2, timeout=15, what="both honest nodes to be listed")
        for viewer in (honest, observer):
            [member] = [m for m in viewer.members() if m.peer_id == honest.peer_id]
            assert (member.record.step, member.record.samples_total) == (7, 56)
    finally:
        forger.shutdown()
        observer.close()
        honest.close()
