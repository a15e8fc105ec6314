"""The tiny trainer of the multi-process tests: one set of config overrides, and small named variants.

Every scenario test (churn, partitions, attackers, shutdown, the CLI end to end) trains the same
1-layer, 32-wide byte GPT with fast membership records, so that a step costs milliseconds and a
peer that left disappears within seconds. A test adds only what it is about, e.g.
``tiny("averaging.sync_every_steps=5")``, or starts from a variant below.
"""

from __future__ import annotations

from collections.abc import Iterable

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "train.batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.eval_batches=2",
    "network.record_interval_s=1",
    "network.record_ttl_s=4",
    "network.startup_timeout_s=120",
]
"""The base: a tiny model, a short warm-up, a cheap evaluation, records every second (ttl 4 s), and
patience for a daemon that starts slowly on a busy machine (a deadline, not a speed)."""

UNLIMITED = "train.max_steps=100000"
"""For trainers the test stops itself (SIGTERM) once what it waits for has happened."""

BACKGROUND = [UNLIMITED, "emulation.step_time_s=0.1"]
"""For trainers that only have to be there (listed by a monitor, dialled, fetched from): no step limit,
and each step padded to 0.1 s on the emulated device (a per-peer key, so the run's config hash is
unchanged), so that they sleep through most of the test instead of taking the cores from what it is
about: a tiny step costs a few milliseconds of CPU, and such a trainer trained ~20 steps/s flat out."""

ANCHOR_CODEC = ["averaging.param_codec=fp16"]
"""A joiner's anchor exchange as in configs/local-tiny.yaml."""

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""The environment of a peer process: several peers share two cores, and torch's default of one
thread per core makes every step several times slower through oversubscription."""


def tiny(*extra: str) -> list[str]:
    """The base overrides followed by ``extra`` (later ones win)."""
    return [*TINY, *extra]


def cli_sets(overrides: Iterable[str]) -> list[str]:
    """``--set`` flags for the ``swarm`` CLI: ``["--set", o1, "--set", o2, ...]``."""
    return [item for override in overrides for item in ("--set", override)]
