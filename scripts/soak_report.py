"""The arithmetic of scripts/soak.py's report: what the trainers' histories, summaries and checkpoints say.

No processes here, only numbers from given inputs (files the trainers wrote), so tests/test_soak.py can
check every figure:

* **samples**: trained (every incarnation's steps, from the step it resumed at to the last step its
  history (``swarm join --history``) holds, or its summary's at the graceful stop; times the batch)
  against accounted for (the steps in each trainer's final checkpoint, times the batch; and each
  trainer's ledger view of the swarm, ``progress.swarm_samples``). Trained minus accounted is the work
  of killed trainers after their last checkpoint, done again after the restart. More accounted than
  trained means samples counted that nobody trained: the report fails; so does a ledger view above
  the samples trained.
* **exchanges that failed**, by role and cause, from the summary (``--summary``,
  ``exchanges_failed_by_cause``) of each incarnation that stopped gracefully. A killed one writes no
  summary: its failed exchanges (both roles, cause unknown) come from the last line of its history.
* **leftover processes** after the graceful stop, and processes of a killed trainer still alive after
  the kill: any makes the report fail.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.metrics import read_history


def last_record(history: Path) -> dict[str, Any] | None:
    """The trainer's own record in the last line of its history, None before its first line (the
    first is its record when it joined, then one per sync)."""
    snapshots = read_history(history) if history.exists() else []
    peers = snapshots[-1]["peers"] if snapshots else []
    return peers[0] if len(peers) == 1 else None


def read_summary(path: Path) -> dict[str, Any] | None:
    """A trainer's ``--summary``, None where it wrote none (killed) or it does not parse."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


@dataclass(frozen=True)
class Life:
    """One incarnation of one trainer, from its start (``resumed_step``: the newest checkpoint's step
    then, 0 when it started fresh) to its kill (``killed``: how) or its graceful stop (``final_step``:
    the steps its summary reports)."""

    trainer: int
    resumed_step: int
    last_step: int | None  # the step in its history's last line; None: it wrote none
    killed: str | None = None
    final_step: int | None = None
    failed: int = 0  # exchanges that did not commit, both roles, in its history's last line
    failures: Counter[tuple[str, str]] | None = None  # by (role, cause), from its summary; None: none
    eval_loss: float | None = None  # its summary's held-out loss of the final model

    @classmethod
    def read(cls, trainer: int, resumed_step: int, killed: str | None, history: Path, summary: Path) -> Life:
        """The life as its history and summary (either may be missing) tell it."""
        record, numbers = last_record(history), read_summary(summary)
        failures = None
        if numbers is not None:
            by_role = numbers.get("exchanges_failed_by_cause") or {}
            failures = Counter({(r, c): n for r, causes in by_role.items() for c, n in causes.items()})
        return cls(
            trainer,
            resumed_step,
            None if record is None else int(record["step"]),
            killed,
            None if numbers is None else int(numbers["steps"]),
            0 if record is None else int(record["exchanges_failed"]) + int(record["exchanges_rejected"]),
            failures,
            None if numbers is None or numbers.get("eval_loss") is None else float(numbers["eval_loss"]),
        )

    @property
    def end_step(self) -> int:
        if self.final_step is not None:
            return self.final_step
        return self.resumed_step if self.last_step is None else max(self.last_step, self.resumed_step)

    @property
    def trained_steps(self) -> int:
        return self.end_step - self.resumed_step


@dataclass(frozen=True)
class FinalState:
    """What one trainer's final checkpoint holds (``progress``)."""

    trainer: int
    step: int
    samples_total: int
    swarm_samples: int

    @classmethod
    def of(cls, trainer: int, progress: dict[str, Any]) -> FinalState:
        """From a checkpoint's ``progress``."""
        step, samples = int(progress["step"]), int(progress["samples_total"])
        return cls(trainer, step, samples, int(progress.get("swarm_samples", 0)))


def account(lives: Sequence[Life], finals: Sequence[FinalState], batch: int) -> dict[str, Any]:
    """Samples trained against samples in the final state (see the module docstring)."""
    trained = sum(life.trained_steps for life in lives) * batch
    accounted = sum(final.samples_total for final in finals)
    kills = sum(1 for life in lives if life.killed)
    views = [final.swarm_samples for final in finals]
    return {
        "batch": batch,
        "trained": trained,
        "accounted": accounted,
        "lost": trained - accounted,
        "lost_share": (trained - accounted) / trained if trained else 0.0,
        "lost_per_kill": (trained - accounted) / kills if kills else 0.0,
        "kills": kills,
        "ledger_min": min(views, default=0),
        "ledger_max": max(views, default=0),
        "checkpoint_samples_match_steps": all(f.samples_total == f.step * batch for f in finals),
    }


@dataclass
class RunResult:
    """One swarm run (the churn run or its baseline), as scripts/soak.py measured it."""

    name: str
    seconds: float
    lives: list[Life]
    finals: list[FinalState]
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    kill_leftovers: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    namespaces_left: list[str] = field(default_factory=list)


def summarize(run: RunResult, batch: int, trainers: int) -> dict[str, Any]:
    """The run's figures and the checks that fail it."""
    samples = account(run.lives, run.finals, batch)
    losses = [life.eval_loss for life in run.lives if life.eval_loss is not None]
    unread = [life for life in run.lives if life.failures is None]
    counts: Counter[tuple[str, str]] = Counter()
    for life in run.lives:
        counts.update(life.failures or {})
    checks = {
        "no_leftover_processes": not run.leftovers and not run.namespaces_left,
        "killed_trainers_left_nothing": not run.kill_leftovers,
        "every_trainer_exited_0": len(run.exit_codes) == trainers + 1
        and all(code == 0 for code in run.exit_codes.values()),
        "every_trainer_has_a_final_checkpoint": len(run.finals) == trainers,
        "no_samples_counted_that_nobody_trained": samples["lost"] >= 0
        and samples["checkpoint_samples_match_steps"],
        "ledger_within_samples_trained": samples["ledger_max"] <= samples["trained"],
    }
    return {
        "name": run.name,
        "seconds": run.seconds,
        "kills": samples["kills"],
        "samples": samples,
        "final_eval_loss": statistics.fmean(losses) if losses else None,
        "eval_losses": losses,
        "steps_per_trainer": statistics.fmean(f.step for f in run.finals) if run.finals else 0.0,
        "failures": _failure_rows(counts),
        # lives without a summary (the killed ones): their failed exchanges, both roles, causes unknown
        "failures_without_cause": {"lives": len(unread), "exchanges": sum(life.failed for life in unread)},
        "exit_codes": run.exit_codes,
        "kill_leftovers": run.kill_leftovers,
        "leftovers": run.leftovers,
        "namespaces_left": run.namespaces_left,
        "checks": checks,
        "ok": all(checks.values()),
    }


def _failure_rows(counts: Counter[tuple[str, str]]) -> list[dict[str, Any]]:
    totals: Counter[str] = Counter()
    for (_, cause), count in counts.items():
        totals[cause] += count
    causes = sorted(totals, key=lambda cause: (-totals[cause], cause))
    return [
        {"cause": cause, "initiator": counts[("initiator", cause)], "responder": counts[("responder", cause)]}
        for cause in causes
    ]


def exit_code(runs: Iterable[dict[str, Any]]) -> int:
    """0 when every run passed its checks, 1 otherwise."""
    return 0 if all(run["ok"] for run in runs) else 1


def render(churn: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    """The report as Markdown tables: figures per run, then failed exchanges by cause, then checks."""
    runs = [churn, *([baseline] if baseline else [])]
    lines = ["| | " + " | ".join(r["name"] for r in runs) + " |", "| --- |" + " --- |" * len(runs)]
    for label, value in _FIGURES:
        lines.append(f"| {label} | " + " | ".join(value(r) for r in runs) + " |")
    lines += [
        "",
        "| failed exchanges (churn run), by cause | as initiator | as responder |",
        "| --- | --- | --- |",
    ]
    rows = churn["failures"] or [{"cause": "(none)", "initiator": 0, "responder": 0}]
    lines += [f"| {r['cause']} | {r['initiator']} | {r['responder']} |" for r in rows]
    unread = churn["failures_without_cause"]
    if unread["lives"]:
        lines.append(
            f"\nlives that wrote no summary (killed), not in the table: {unread['lives']}, with "
            f"{unread['exchanges']} failed exchanges (both roles, cause unknown) in their histories"
        )
    lines.append("")
    for run in runs:
        failed = [name for name, passed in run["checks"].items() if not passed]
        verdict = "all checks passed" if not failed else "FAILED: " + ", ".join(failed)
        lines.append(f"{run['name']}: {verdict}")
        for what in ("leftovers", "kill_leftovers", "namespaces_left"):
            lines += [f"  {what}: {item}" for item in run[what]]
    return "\n".join(lines)


def _loss(run: dict[str, Any]) -> str:
    loss = run["final_eval_loss"]
    return "-" if loss is None else f"{loss:.3f}"


_FIGURES = [
    ("seconds of training", lambda r: f"{r['seconds']:.0f}"),
    ("kills (SIGKILL + restart with --resume)", lambda r: str(r["kills"])),
    ("samples trained", lambda r: f"{r['samples']['trained']:,}"),
    ("samples in the final checkpoints", lambda r: f"{r['samples']['accounted']:,}"),
    (
        "lost (trained after a killed trainer's last checkpoint)",
        lambda r: f"{r['samples']['lost']:,} ({r['samples']['lost_share']:.1%})",
    ),
    ("lost per kill", lambda r: f"{r['samples']['lost_per_kill']:.0f}"),
    ("ledger's swarm samples, min-max over trainers", lambda r: _ledger(r["samples"])),
    ("steps per trainer (final checkpoints, mean)", lambda r: f"{r['steps_per_trainer']:.0f}"),
    ("final held-out loss, bits/byte (mean)", _loss),
    (
        "failed exchanges (both roles)",
        lambda r: str(
            sum(f["initiator"] + f["responder"] for f in r["failures"])
            + r["failures_without_cause"]["exchanges"]
        ),
    ),
    ("leftover processes after the stop", lambda r: str(len(r["leftovers"]))),
]


def _ledger(samples: dict[str, Any]) -> str:
    return f"{samples['ledger_min']:,}-{samples['ledger_max']:,}"
