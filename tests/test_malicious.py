"""Malicious peers: a 5-trainer swarm with one attacker still trains, and the attacker is banned.

Three swarms of five trainers (tests/malicious_worker.py, one process each) train the same tiny
model: a clean one, one where peer 0 sends its pseudo-gradients scaled x100, and one where it sends
standard normal noise. The honest peers' final held-out loss must stay within ``LOSS_MARGIN`` bits
per byte of the clean swarm's (same identities, so the same data), and every honest peer must have
banned the attacker. Undefended, the same attacks take every peer to Inf/NaN (docs/gossip.md).

A last, in-process test checks that nobody can overwrite another peer's membership record (and so
its announced progress), even with a well-formed record signed by a key of its own.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import hivemind
import psutil
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm import NetworkOptions, NodeInfo, PeerRecord, SwarmNode
from swarm.membership import record_key
from swarm.network import ensure_identity
from tests._processes import wait_until
from tests.gossip_helpers import p2pd_pids, wait_no_leak
from tests.malicious_worker import Swarm

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "train.batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.eval_batches=4",
    "train.max_steps=100",
    "averaging.sync_every_steps=5",
    "averaging.param_sync_every=5",
    "averaging.max_drift=0.15",
    "averaging.param_codec=fp16",
    # a banned attacker stays banned until the end, so the summaries show it
    "averaging.ban_base_s=120",
    "averaging.ban_max_s=240",
    "network.record_interval_s=1",
    "network.record_ttl_s=4",
]
LOSS_MARGIN = 0.5  # bits per byte: clean-run noise at this size and length, see docs/gossip.md


@pytest.fixture
def swarms() -> Iterator[list[Swarm]]:
    """Swarms started by the test; at teardown they are closed and none of their p2pd survives."""
    before = p2pd_pids()
    started: list[Swarm] = []
    yield started
    for swarm in started:
        swarm.close()
    pgids = [pgid for swarm in started for pgid in swarm.pgids]
    assert not wait_no_leak(before, pgids, parent=psutil.Process().pid)


def _run(swarms: list[Swarm], tmp_path: Path) -> dict[str, list[dict]]:
    """Train a clean and two attacked swarms side by side; return each one's peer summaries."""
    kinds = {"clean": None, "scaled": "scaled", "random": "random"}
    identities = [str(ensure_identity(tmp_path / f"peer-{i}.key")) for i in range(5)]
    runs = {
        name: Swarm([f"run.run_id=malicious-{name}", *TINY], attack, identities)
        for name, attack in kinds.items()
    }
    swarms.extend(runs.values())
    for step in (Swarm.start_first, Swarm.start_rest, Swarm.wait_ready):  # all swarms start in parallel
        for swarm in runs.values():
            step(swarm)
    paths = {}
    for name, swarm in runs.items():
        (tmp_path / name).mkdir()
        paths[name] = swarm.go(tmp_path / name)
    for swarm in runs.values():
        swarm.wait_done(timeout=300)
    return {name: [json.loads(p.read_text()) for p in paths[name]] for name in runs}


@pytest.mark.multipeer
def test_honest_peers_train_through_an_attacker_and_ban_it(swarms, tmp_path) -> None:
    started = time.monotonic()
    results = _run(swarms, tmp_path)
    # the same identities, so the same data, as the attacked swarms' honest peers 1-4
    clean = statistics.fmean(peer["eval_loss"] for peer in results["clean"][1:])
    report = {"clean": round(clean, 3), "seconds": round(time.monotonic() - started)}
    for attack in ("scaled", "random"):
        attacker, *honest = results[attack]
        loss = statistics.fmean(peer["eval_loss"] for peer in honest)
        report[attack] = {
            "honest_loss": round(loss, 3),
            "per_peer": [round(peer["eval_loss"], 3) for peer in results[attack]],
            "clipped": [peer["exchanges_clipped"] for peer in honest],
            "suspect": [peer["exchanges_suspect"] for peer in honest],
            "strikes": [peer["ban_strikes"].get(attacker["peer_id"], 0) for peer in honest],
        }
        print(report)
        assert loss <= clean + LOSS_MARGIN, report
        for peer in honest:
            assert attacker["peer_id"] in peer["banned_peers"], (attack, peer["peer_id"], report)


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
