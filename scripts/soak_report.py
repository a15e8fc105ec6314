"""The arithmetic of scripts/soak.py's report: what the trainers' logs, summaries and checkpoints say.

No processes here, only numbers from given inputs, so tests/test_soak.py can check every figure:

* **samples**: trained (every incarnation's steps, from the step it resumed at to the last step it
  printed, or its summary at the graceful stop; times the batch) against accounted for (the steps in
  each trainer's final checkpoint, times the batch; and each trainer's ledger view of the swarm,
  ``progress.swarm_samples``). Trained minus accounted is the work of killed trainers after their last
  checkpoint, done again after the restart. More accounted than trained means samples counted that
  nobody trained: the report fails; so does a ledger view above the samples trained.
* **exchanges that failed**, by cause, from the INFO line the gossip averager logs for each exchange
  that did not commit (``swarm.gossip._metrics.log_failure``), per role.
* **leftover processes** after the graceful stop, and processes of a killed trainer still alive after
  the kill: any makes the report fail.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

FAILURE_LINE = re.compile(r"exchange failed as (\w+) with (\S+) at (\w+) \((\w+)\): (.*)$")
_PEER_ID = re.compile(r"^(?:\S+ )?\S{40,}: ")  # "12D3KooW...: " before a dialled partner's answer


@dataclass(frozen=True)
class SyncLine:
    """One per-sync line of a trainer (peers/_trainer_output.py): step, outcome, held-out loss."""

    step: int
    outcome: str
    eval_loss: float | None


def sync_lines(text: str) -> list[SyncLine]:
    """The per-sync lines in a trainer's output, parsed (the words keep their positions)."""
    found = []
    for line in text.splitlines():
        words = line.split()
        if len(words) > 16 and words[0] == "round" and words[2] == "step" and words[12] == "sync":
            evaluation = None if words[7] == "-" else float(words[7])
            found.append(SyncLine(int(words[3]), words[13], evaluation))
    return found


def failure_cause(stage: str, outcome: str, reason: str) -> str:
    """``STAGE OUTCOME: KIND``, KIND being the reason's first part (an exception name, "exchange timed
    out", a partner's refusal) without the partner id in front of it."""
    text = _PEER_ID.sub("", reason.strip(), count=1)
    kind = text.split(":", 1)[0].strip() or "no reason given"
    return f"{stage} {outcome}: {kind}"


def failures(text: str) -> Counter[tuple[str, str]]:
    """Exchanges that did not commit in one trainer's output, counted by (role, cause)."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in text.splitlines():
        match = FAILURE_LINE.search(line)
        if match:
            role, _, stage, outcome, reason = match.groups()
            counts[(role, failure_cause(stage, outcome, reason))] += 1
    return counts


@dataclass(frozen=True)
class Life:
    """One incarnation of one trainer, from its start (``resumed_step``: the newest checkpoint's step
    then, 0 when it started fresh) to its kill (``killed``: how) or its graceful stop (``final_step``:
    the steps its summary reports)."""

    trainer: int
    resumed_step: int
    last_step: int | None  # the last step it printed a sync line at; None: it printed none
    killed: str | None = None
    final_step: int | None = None

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
    eval_losses: list[float]
    failures: Counter[tuple[str, str]] = field(default_factory=Counter)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    kill_leftovers: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    namespaces_left: list[str] = field(default_factory=list)


def summarize(run: RunResult, batch: int, trainers: int) -> dict[str, Any]:
    """The run's figures and the checks that fail it."""
    samples = account(run.lives, run.finals, batch)
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
        "final_eval_loss": statistics.fmean(run.eval_losses) if run.eval_losses else None,
        "eval_losses": run.eval_losses,
        "steps_per_trainer": statistics.fmean(f.step for f in run.finals) if run.finals else 0.0,
        "failures": _failure_rows(run.failures),
        "exit_codes": run.exit_codes,
        "kill_leftovers": run.kill_leftovers,
        "leftovers": run.leftovers,
        "namespaces_left": run.namespaces_left,
        "checks": checks,
        "ok": all(checks.values()),
    }


def _failure_rows(counts: Counter[tuple[str, str]]) -> list[dict[str, Any]]:
    causes = sorted({cause for _, cause in counts}, key=lambda c: -sum(counts[(r, c)] for r, _ in counts))
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
        lambda r: str(sum(f["initiator"] + f["responder"] for f in r["failures"])),
    ),
    ("leftover processes after the stop", lambda r: str(len(r["leftovers"]))),
]


def _ledger(samples: dict[str, Any]) -> str:
    return f"{samples['ledger_min']:,}-{samples['ledger_max']:,}"
