"""Every attack of issue 28 at once: 4 honest trainers among hostile peers train as a clean swarm does.

Two swarms train the same tiny model side by side (tests/workers/malicious.py, one process per
trainer, the same identities and so the same data shards in both): a clean one of the 4 honest
trainers alone, and an attacked one of the same 4 with, at the same time,

* a trainer whose HELLOs claim 1e29 samples and that sends its pseudo-gradient negated (finding 1);
* a trainer that stops after the first frame of every exchange and holds the stream (finding 9);
* three hostile nodes (tests/workers/hostile.py) whose trainer records claim 10**15 samples while the
  run sets ``run.target_samples`` (finding 3), that announce and serve one poisoned state with a
  progress of 2**63 - 1 samples (findings 2 and 7), and two of which publish run configs: the honest
  hash with a hostile per-peer key, "published" far in the future, and a YAML alias bomb (4 and 6);
* an honest organizer (a bootstrap-role node publishing the run's config, serving no state), through
  which a joiner comes in once the honest trainers announce at least 3 distinct states.

Checked: every honest trainer, in both swarms, trains all its steps (the fake samples do not end the
run); the median held-out loss of the 4 honest trainers under attack is within ``LOSS_TOLERANCE`` of
the clean swarm's, and every one of them is finite; the config a joiner pulls through the organizer is
the organizer's (in time: the alias bomb is never parsed); the joiner takes over the median of at
least 3 trainers' states (or, when they all move on under its download, a partner's model through a
clipped exchange), never the poisoned digest nor its progress, and trains all its steps to a loss
within the same bound; no peer crashes; nothing outlives the test (processes, p2p daemons). The relay
(finding 8) is not part of it: these trainers relay nothing (``tests/test_hostile_relay.py`` covers
it).

Measured on the shared 2-core machine: alone, 92 s, mean held-out loss clean 4.731, attacked 4.730; in
a full suite run, 163 s, clean 4.828, attacked 4.655, joiner 4.792 (it adopted a partner's model: the
donors moved on under each of its three attempts). One trainer of four sometimes ends far from the
others after 40 steps, in either swarm: 5.11 against 4.54-4.73 in a clean swarm, 5.86 against
4.59-5.16 in another, 6.54 against 4.62-5.13 in an attacked one under a full suite's load. The
outlier's rounds look like the others' (the same anchor norm, momentum and drift within a few percent,
traced per applied update), and every outer step moves the anchor by about 10% of its norm, so where a
trainer's last one falls before its end likely decides it. Hence the median: the 5% bound (about 0.24
bits per byte) holds that noise, while an undefended attack drives every honest trainer's loss to
Inf/NaN (docs/gossip.md).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from peers._compat_check import look_at_swarm
from swarm import NetworkOptions
from swarm.config import load_config
from swarm.membership import parse_config_text
from swarm.network import ensure_identity
from tests._processes import heavy_scenario, wait_until
from tests.workers.hostile import HOSTILE_STEP_TIME_S, HostileNodes, Organizer
from tests.workers.malicious import Swarm, swarms_stopped_cleanly
from tests.workers.tiny import ANCHOR_CODEC, tiny

HONEST = [0, 1, 2, 3]
ATTACKERS = {4: "claim", 5: "stall"}
JOINER = 6  # the identity of the joiner
SWARMS = {"clean": (HONEST, {}), "attacked": ([*HONEST, *ATTACKERS], ATTACKERS)}
STEPS = 40
TARGET_SAMPLES = 10**6  # far beyond what the run trains, far below what the fake records claim
OVERRIDES = tiny(
    "train.eval_batches=8",
    f"train.max_steps={STEPS}",
    "averaging.sync_every_steps=5",
    f"run.target_samples={TARGET_SAMPLES}",
    *ANCHOR_CODEC,
    # a round every 2.5 s: a donor serves only its latest state, and a joiner's view of the records is
    # up to a record interval (1 s) old, so faster rounds (tiny steps take milliseconds) move every
    # honest donor on before the joiner asks ("digest mismatch"); padding sleeps, so it costs no CPU
    "emulation.step_time_s=0.5",
)
LOSS_TOLERANCE = 0.05  # of the clean swarm's mean held-out loss


@pytest.fixture
def swarms() -> Iterator[list[Swarm]]:
    """Swarms started by the test, stopped at teardown and checked for leaks."""
    with swarms_stopped_cleanly() as started:
        yield started


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """``closing(thing)`` returns ``thing`` and closes it at teardown (before ``swarms`` checks leaks)."""
    opened: list[Any] = []

    def add(thing: Any) -> Any:
        opened.append(thing)
        return thing

    yield add
    for thing in reversed(opened):
        thing.close()


def _honest_states(organizer: Organizer, honest_ids: set[str]) -> int:
    """How many distinct states the honest trainers announce (at first all the same: the seed's)."""
    members = organizer.members()
    return len({m.record.state_hash for m in members if m.peer_id in honest_ids and m.record.state_hash})


@heavy_scenario
@pytest.mark.multipeer
@pytest.mark.timeout(480)  # a hang guard: its own waits add up to more than 300 s on a loaded machine
def test_honest_trainers_train_through_every_attack_at_once(swarms, closing, tmp_path: Path) -> None:
    started = time.monotonic()
    identities = [str(ensure_identity(tmp_path / f"peer-{i}.key")) for i in range(JOINER + 1)]
    runs = {
        name: Swarm(
            [f"run.run_id=hostile-swarm-{name}", *OVERRIDES], attacks, [identities[i] for i in members]
        )
        for name, (members, attacks) in SWARMS.items()
    }
    swarms.extend(runs.values())
    for step in (Swarm.start_first, Swarm.start_rest, Swarm.wait_ready):  # both swarms start in parallel
        for swarm in runs.values():
            step(swarm)
    attacked = runs["attacked"]
    config = load_config(None, overrides=attacked.overrides, env={})
    organizer = closing(Organizer(config, attacked.first_maddrs))
    hostile = closing(HostileNodes(config, attacked.first_maddrs))
    hostile.publish_configs(config)
    joiner = Swarm(attacked.overrides, {}, [identities[JOINER]])
    swarms.append(joiner)
    joiner.start_joining(organizer.visible_maddrs())  # built now, joins on "go"
    paths = {}
    for name, swarm in runs.items():
        (tmp_path / name).mkdir()
        paths[name] = swarm.go(tmp_path / name)

    # findings 4 and 6: a joiner told about the organizer pulls the organizer's config, at once
    view = look_at_swarm(organizer.node, NetworkOptions(initial_peers=organizer.visible_maddrs()), None)
    assert view.run_id == config.run.run_id and view.published_hash == config.config_hash(), view
    assert view.published_yaml is not None
    assert parse_config_text(view.published_yaml).emulation.step_time_s != HOSTILE_STEP_TIME_S

    # the joiner comes in once the honest trainers announce 3 distinct states, beside the Sybils' one
    honest_ids = {attacked.peer_ids[i] for i in HONEST}
    wait_until(lambda: _honest_states(organizer, honest_ids) >= 3, 120, "3 distinct honest states")
    listed = lambda: set(hostile.peer_ids) <= {m.peer_id for m in organizer.members()}  # noqa: E731
    wait_until(listed, 30, "the hostile records to be listed")
    (tmp_path / "joiner").mkdir()
    [joiner_path] = joiner.go(tmp_path / "joiner")

    honest = range(len(HONEST))
    reports = {name: swarm.wait_done(timeout=240, indices=honest) for name, swarm in runs.items()}
    [joined] = [report["joined"] for report in joiner.wait_done(timeout=240)]
    summaries = {name: [json.loads(paths[name][i].read_text()) for i in honest] for name in runs}
    joiner_summary = json.loads(joiner_path.read_text())
    losses = {name: statistics.median(peer["eval_loss"] for peer in summaries[name]) for name in runs}
    report = {
        "seconds": round(time.monotonic() - started),
        "loss": {name: round(loss, 3) for name, loss in losses.items()},
        "per_peer": {name: [round(peer["eval_loss"], 3) for peer in summaries[name]] for name in runs},
        "steps": {name: [peer["steps"] for peer in summaries[name]] for name in runs},
        "joiner": {
            "donors": [attacked.peer_ids.index(d) if d in attacked.peer_ids else d for d in joined["donors"]],
            "meta": joined["meta"],
            "steps": joiner_summary["steps"],
            "loss": round(joiner_summary["eval_loss"], 3),
        },
        "bans": {i: len(reports["attacked"][i]["bans"]) for i in honest},
    }  # fmt: skip
    print(report)

    # finding 3: no trainer stopped at the fake records' samples
    for name in runs:
        assert [peer["steps"] for peer in summaries[name]] == [STEPS] * len(HONEST), (name, report)
    # findings 1 and 9: the honest trainers' model is as good as without the attackers
    assert all(math.isfinite(peer["eval_loss"]) for peer in summaries["attacked"]), report
    assert losses["attacked"] <= losses["clean"] * (1 + LOSS_TOLERANCE), report
    # findings 2 and 7: a joiner that took donors' states took the median of at least 3 trainers'
    # (the attacking trainers' own models may be among them: they train on real data), none of the
    # Sybils', and progress that some trainer really made. Under load the honest donors may all move
    # on during its three attempts ("digest mismatch"): then it adopts a partner's model through a
    # clipped exchange (docs/security.md), never the poison's
    donors = set(joined["donors"])
    if donors:
        assert len(donors) >= 3 and donors <= set(attacked.peer_ids), report
        assert joined["digest"] != hostile.poison.digest, report
        assert joined["meta"]["samples_total"] <= STEPS * config.train.batch_size, report
    # either way it trained every step (the poison's progress would stop it at once) to an honest
    # model (the poison is 10 off in every coordinate, beyond what 40 steps of clipped exchanges undo)
    assert joiner_summary["steps"] == STEPS, report
    assert joiner_summary["eval_loss"] <= losses["clean"] * (1 + LOSS_TOLERANCE), report
