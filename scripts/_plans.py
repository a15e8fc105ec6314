"""What scripts/bench_report.py runs: the comparison, the speed-up over one device, the gossip sweep.

Every run uses the bench regime (``_runner.REGIME``): per-peer batch 1 at the learning rate
that batch wants, each inner step on an emulated device of ``emulation.step_time_s`` seconds, links
shaped so that one int8 exchange takes at least half a round of device time (:func:`link_rate`).

* **Comparison** (:func:`comparison_plans`): 4 trainers, the last one 3x slower, the same budget for
  gossip int8 and int4, ``allreduce`` (OpenDiLoCo), ``dataparallel`` (the same backend with H = 1,
  outer lr 1 and no momentum: every peer's AdamW step averaged at every step), ``hivemind.Optimizer``
  and one solo device.
* **Scaling** (:func:`scaling_plans`): time to the target with N = 1, 2, 4, 8 equal devices. One
  device is plain AdamW (``backend: none``, outer lr 1, no momentum). ``dataparallel`` here is the
  ideal synchronous data-parallel run, gradients all-reduced at no cost: N devices doing batch b each
  compute, every step, exactly the gradient one device computes on batch N * b, so it runs as one
  trainer with batch N * b on the same emulated device. Gossip runs N trainers over the shaped links.
* **Sweep** (:func:`sweep_plans`): gossip's outer learning rate, momentum and H with 4 equal trainers.
"""

from __future__ import annotations

import itertools
from typing import Any

from scripts import _runner
from scripts._runner import Plan

GOSSIP: dict[str, float | str] = {
    "sync_every_steps": 5,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "partners": "hypercube",
    "max_lag_rounds": 3,
}
"""gossip's settings in the bench regime (``averaging.*``, docs/benchmarks.md "Choosing the regime"):
H, the outer step, partners on the hypercube schedule, and how many rounds an exchange may lag before
the device waits (``scripts/bench_lag.py``).
H = 5 over links sized to it (:func:`link_rate`) reached the target in 25-30% less time than H = 20
once the training loop stopped waiting on the DHT after each round."""

EVAL_SECONDS = 4.0
"""A trainer of a swarm evaluates about this often (a held-out batch costs about one inner step of real
compute, outside the device time: evaluating every round would take a tenth of the wall time); a
one-device run every ``EVAL_SECONDS / 2``, since its curve is the only one it has. Times to the target
are interpolated between evaluations (:func:`crossing`)."""

INT8_GOODPUT = 0.957  # tbf counts wire bytes; TCP payload is 0.957 of them (docs/testbed.md)
INT8_BYTES_PER_PARAM = 1.085  # one whole-model int8 exchange as sent, frames included (measured)


def link_rate(n_params: int, sync_every: int, step_time_s: float) -> str:
    """The fastest rate, in steps of 0.5 Mbit/s, at which one int8 exchange of the model takes at
    least half a round (``sync_every`` inner steps) of device time."""
    half_round = sync_every * step_time_s / 2
    bits_per_s = n_params * INT8_BYTES_PER_PARAM * 8 / half_round / INT8_GOODPUT
    kbit = max(500, int(bits_per_s / 500e3) * 500)
    return f"{kbit}kbit"


def regime_rate(sync_every: int | None = None) -> str:
    """:func:`link_rate` of the bench model on the regime's emulated device, for H = ``sync_every``
    (default: gossip's H in ``GOSSIP``)."""
    h = int(GOSSIP["sync_every_steps"]) if sync_every is None else sync_every
    return link_rate(_runner.n_params(), h, _runner.REGIME["step_time_s"])


def exchange_seconds(bytes_per_param: float, n_params: int, rate_kbit: float) -> float:
    """Seconds one exchange of ``bytes_per_param`` takes over a link of ``rate_kbit`` (goodput)."""
    return bytes_per_param * n_params * 8 / (rate_kbit * 1e3 * INT8_GOODPUT)


def _outer(sync_every: int, lr: float, momentum: float) -> list[str]:
    return [
        f"averaging.sync_every_steps={sync_every}",
        f"averaging.outer_lr={lr}",
        f"averaging.outer_momentum={momentum}",
    ]


def _setting(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def _eval_every(rounds_per_second: float, seconds: float = EVAL_SECONDS) -> int:
    return max(1, round(seconds * rounds_per_second))


def _round_seconds(sync_every: int) -> float:
    return sync_every * _runner.REGIME["step_time_s"]


def gossip_sets(codec: str = "int8", **overrides: float) -> list[str]:
    """gossip with ``GOSSIP``'s settings, or ``overrides`` of them; every exchange is a round for both
    sides, and a trainer takes part in about one exchange per H steps."""
    settings = {**GOSSIP, **overrides}
    evals = _eval_every(1 / _round_seconds(int(settings["sync_every_steps"])))
    averaging = [f"averaging.{key}={_setting(value)}" for key, value in settings.items()]
    sets = _runner.regime_sets(eval_every_rounds=evals)
    return [*sets, "averaging.backend=gossip", f"compression.codec={codec}", *averaging]


def single_sets(batch: int) -> list[str]:
    """One device, plain AdamW: DiLoCo alone with outer lr 1 and no momentum changes nothing."""
    evals = _eval_every(1 / _round_seconds(10), EVAL_SECONDS / 2)
    return [
        *_runner.regime_sets(batch, eval_every_rounds=evals),
        "averaging.backend=none",
        *_outer(10, 1.0, 0.0),
    ]


def comparison_plans(peers: int, budget_s: float, slow_peer: int | None) -> list[Plan]:
    """gossip int8 and int4, allreduce, dataparallel, hivemind.Optimizer and solo, one budget."""
    h = int(GOSSIP["sync_every_steps"])
    outer = _outer(h, float(GOSSIP["outer_lr"]), float(GOSSIP["outer_momentum"]))
    allreduce = [
        *_runner.regime_sets(eval_every_rounds=_eval_every(1 / _round_seconds(h))),
        "averaging.backend=allreduce",
        "compression.codec=int8",
    ]
    # every data-parallel step waits for its all-reduce: seconds over these links
    dataparallel = [
        *_runner.regime_sets(eval_every_rounds=1),
        "averaging.backend=allreduce",
        "compression.codec=int8",
        *_outer(1, 1.0, 0.0),
    ]
    hivemind = [
        *_runner.regime_sets(eval_every_rounds=_eval_every(1 / _round_seconds(h))),
        "averaging.backend=hivemind",
        "compression.codec=int8",
        f"averaging.sync_every_steps={peers * h}",
    ]
    swarm = {"peers": peers, "slow_peer": slow_peer, "budget_s": budget_s}
    return [
        Plan("gossip-int8", "gossip-int8", sets=gossip_sets("int8"), label="swarm gossip, int8", **swarm),
        Plan("gossip-int4", "gossip-int4", sets=gossip_sets("int4"), label="swarm gossip, int4", **swarm),
        Plan(
            "allreduce",
            "allreduce",
            sets=[*allreduce, *outer],
            label="all-reduce (OpenDiLoCo), int8",
            **swarm,
        ),
        Plan(
            "dataparallel",
            "dataparallel",
            sets=dataparallel,
            label="data-parallel (all-reduce, H = 1), unshaped links",
            rate=None,
            **swarm,
        ),
        Plan("hivemind", "hivemind", sets=hivemind, label="hivemind.Optimizer, int8 blockwise", **swarm),
        Plan("solo", "solo", 1, single_sets(1), "solo (one device, plain AdamW)", budget_s=budget_s),
    ]


def scaling_plans(counts: list[int], cap_s: float) -> list[Plan]:
    """Time to target with N equal devices: one device, ideal data-parallel and gossip int8 for each N."""
    batch = int(_runner.REGIME["batch_size"])
    until = {"budget_s": cap_s, "until_target": True}
    plans = [Plan("scale-one-1", "one device", 1, single_sets(batch), "one device", **until)]
    for n in sorted(c for c in counts if c > 1):
        plans.append(
            Plan(
                f"scale-dataparallel-{n}",
                "dataparallel",
                1,
                single_sets(n * batch),
                f"ideal data-parallel, {n} devices",
                batch=n * batch,
                devices=n,
                **until,
            )
        )
        plans.append(
            Plan(
                f"scale-gossip-int8-{n}",
                "gossip-int8",
                n,
                gossip_sets("int8"),
                f"gossip int8, {n} trainers",
                **until,
            )
        )
    return plans


SWEEP: list[dict[str, float]] = [
    {"sync_every_steps": 10, "outer_lr": 0.7, "outer_momentum": 0.9},
    {"sync_every_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.0},
    {"sync_every_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.5},
    {"sync_every_steps": 10, "outer_lr": 1.5, "outer_momentum": 0.0},
    {"sync_every_steps": 5, "outer_lr": 1.0, "outer_momentum": 0.0},
    {"sync_every_steps": 20, "outer_lr": 1.0, "outer_momentum": 0.0},
    {"sync_every_steps": 5, "outer_lr": 0.7, "outer_momentum": 0.9},
]
"""Overrides of ``GOSSIP`` tried for gossip in the bench regime (the second is local-tiny's own H and
outer step)."""


def sweep_label(overrides: dict[str, float]) -> str:
    s = {**GOSSIP, **overrides}
    return f"H = {s['sync_every_steps']:g}, outer lr {s['outer_lr']:g}, momentum {s['outer_momentum']:g}"


def sweep_plans(grid: list[dict[str, float]], peers: int, budget_s: float) -> list[Plan]:
    """gossip int8 with ``peers`` equal trainers for each setting of ``grid``, each over links that make
    one int8 exchange take half of its round (:func:`link_rate` of its H)."""
    plans = []
    for index, overrides in enumerate(grid, 1):
        sets = gossip_sets("int8", **overrides)
        h = int({**GOSSIP, **overrides}["sync_every_steps"])
        rate = regime_rate(h)
        label = sweep_label(overrides)
        plans.append(Plan(f"sweep-{index}", "gossip-int8", peers, sets, label, budget_s=budget_s, rate=rate))
    return plans


def scaling_points(
    rows: list[dict[str, Any]], backends: tuple[str, ...] = ("gossip-int8", "dataparallel")
) -> list:
    """``scaling.points``: per backend and device count, seconds to target and speed-up vs one device.

    N = 1 is the one-device run for every backend (with one device there is nothing to average).
    ``speedup_vs_one`` is the one device's time over this one; when a run missed the target it is
    an upper bound (one device's time over the run's budget), marked by ``reached: false``.
    """
    one = next((r for r in rows if r.get("backend") == "one device" and "error" not in r), None)
    base = one.get("seconds_to_target") if one else None
    points = []
    for backend in backends:
        runs = [r for r in rows if r.get("backend") == backend and r.get("name", "").startswith("scale-")]
        for row in [one, *runs] if one else runs:
            points.append(_point(backend, row, base))
    return points


def _point(backend: str, row: dict[str, Any], base: float | None) -> dict[str, Any]:
    seconds = row.get("seconds_to_target")
    reached = seconds is not None
    bound = seconds if reached else row.get("seconds") or row.get("budget_s")
    point = {"backend": backend, "peers": row.get("devices", row.get("peers")), "seconds_to_target": seconds}
    point["speedup_vs_one"] = base / bound if base and bound and "error" not in row else None
    point |= {"reached": reached, "run": row.get("name"), "error": row.get("error")}
    point["samples_to_target"] = row.get("samples_to_target")
    return point


def eval_at(curve: list[list[float]], samples: float) -> float | None:
    """The swarm's mean eval loss when it had processed ``samples``, interpolated linearly between the
    curve's points; None before its first point or beyond its last."""
    points = [(n, loss) for _, n, loss in curve]
    if not points or not points[0][0] <= samples <= points[-1][0]:
        return None
    for (n0, l0), (n1, l1) in itertools.pairwise(points):
        if n0 <= samples <= n1:
            return l1 if n1 == n0 else l0 + (l1 - l0) * (samples - n0) / (n1 - n0)
    return points[0][1]


def equal_samples(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Set each row's ``eval_at_equal_samples``: its eval loss at the largest sample count every
    measured row reached (None for a row whose first evaluation came later); return that count."""
    measured = [r for r in rows if "error" not in r and r.get("curve")]
    common = min((r["curve"][-1][1] for r in measured), default=None)
    for row in rows:
        row["eval_at_equal_samples"] = eval_at(row["curve"], common) if row in measured else None
    return {"equal_samples": common}


def paired_evals(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float | None, float | None] | None:
    """(samples, eval of a, eval of b) at the largest sample count both rows reached."""
    if not a.get("curve") or not b.get("curve"):
        return None
    common = min(a["curve"][-1][1], b["curve"][-1][1])
    return common, eval_at(a["curve"], common), eval_at(b["curve"], common)


# ---------------------------------------------------------------------- markdown and plot


def fmt(value: Any, spec: str = ".2f", none: str = "-") -> str:
    """``value`` formatted by ``spec``, ``none`` when it is None."""
    return none if value is None else format(value, spec)


def _load(row: dict[str, Any]) -> str:
    load = row.get("load_average") or {}
    return f"{fmt(load.get('mean'), '.1f')} / {fmt(load.get('max'), '.1f')}"


def _compute(row: dict[str, Any]) -> str:
    compute, step = row.get("compute_per_step_s"), row.get("step_time_s")
    return f"{1000 * compute:.0f} / {1000 * step:.0f} ms" if compute is not None and step else "-"


def render_scaling(scaling: dict[str, Any], image: str | None) -> list[str]:
    """The speed-up section: one row per backend and device count."""
    lines = ["### Speed-up over one device", ""]
    if "skipped" in scaling:
        return [*lines, f"Skipped: {scaling['skipped']}.", ""]
    reused = f"Reused from `{scaling['reused']}`. " if scaling.get("reused") else ""
    lines += [
        f"{reused}Time to {scaling['target']:g} bits/byte with N equal devices (no slow one), each inner "
        f"step on an emulated device of {scaling['step_time_s']:g} s, each run stopped at "
        f"the target or after {scaling['cap_s']:.0f} s. One device: plain AdamW, batch "
        f"{scaling['batch_size']:g}. Data-parallel: the ideal synchronous run, gradients all-reduced at no "
        f"cost, which computes exactly what one device with batch N x {scaling['batch_size']:g} computes, "
        "so it runs as that one trainer on the same emulated device (its speed-up is what perfect "
        "data parallelism gains in this regime, the ceiling for any swarm). gossip int8: N trainers over "
        f"{scaling['rate']} links, H = {scaling['sync_every_steps']:g}, outer lr {scaling['outer_lr']:g}, "
        f"momentum {scaling['outer_momentum']:g}, exchanges lagging up to "
        f"{scaling.get('max_lag_rounds', 1):g} rounds. Speed-up: one device's time over the run's (a run "
        "that missed the target gives an upper bound, marked <). Samples: the swarm's samples when the mean "
        "eval first reached the target. Compute and load as in the training table.",
        "",
        "| backend | devices | s to target | speed-up vs one | ideal | samples to target | join spread "
        "| compute / step time | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    runs = {row.get("name"): row for row in scaling.get("runs", [])}
    for p in scaling.get("points", []):
        run = runs.get(p.get("run"), {})
        bound = "" if p.get("reached") else "< "
        speed = fmt(p.get("speedup_vs_one"), ".2f")
        values = [p["backend"], str(p["peers"]), fmt(p.get("seconds_to_target"), ".1f", "not reached")]
        values += [f"{bound}{speed}x", f"{p['peers']}x", fmt(run.get("samples_to_target"), ",.0f")]
        values += [fmt(run.get("join_spread_s"), ".1f"), _compute(run), _load(run)]
        lines.append("| " + " | ".join(values) + " |")
    errors = [f"{r['name']}: {r['error']}" for r in scaling.get("runs", []) if r.get("error")]
    lines += ["", *[f"Failed: {e}" for e in errors]] if errors else []
    if image:
        lines += ["", f"![speed-up vs devices]({image})"]
    return [*lines, ""]


def render_sweep(sweep: dict[str, Any]) -> list[str]:
    """The gossip sweep: one row per (H, outer lr, momentum)."""
    if "skipped" in sweep:
        return []
    lines = [
        "### Sweep: gossip's outer settings",
        "",
        (f"Reused from `{sweep['reused']}`: " if sweep.get("reused") else "")
        + f"gossip int8, {len(sweep['rows'][0].get('per_peer', [])) or '-'} equal trainers, "
        f"{sweep['budget_s']:.0f} s each, in the bench regime; each setting over links on which one int8 "
        "exchange takes half of its round (so a smaller H gets faster links).",
        "",
        f"Eval at equal samples: when the swarm had processed {fmt(sweep.get('equal_samples'), ',.0f')} "
        "samples, the most that every setting reached; it does not depend on how fast the machine was.",
        "",
        "| setting | links | s to target | final eval | eval at equal samples | utilization | B/param/sync "
        "| compute / step time | load | steps/trainer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in sweep["rows"]:
        if row.get("error"):
            lines.append(f"| {row['label']} | {row.get('rate')} | failed: {row['error']} |" + " |" * 7)
            continue
        values = [row["label"], row.get("rate") or "unshaped"]
        values.append(fmt(row.get("seconds_to_target"), ".1f", "not reached"))
        values += [fmt(row.get("final_eval_loss"), ".3f"), fmt(row.get("eval_at_equal_samples"), ".3f")]
        values += [fmt(row.get("utilization"), ".0%"), fmt(row.get("wire_bytes_per_param_per_sync"), ".2f")]
        values += [_compute(row), _load(row), fmt(row.get("steps_per_peer"), ".0f")]
        lines.append("| " + " | ".join(values) + " |")
    return [*lines, ""]


def plot_scaling(scaling: dict[str, Any], path) -> bool:
    """Speed-up vs devices per backend, with the ideal line; False (nothing written) without points."""
    points = [p for p in scaling.get("points", []) if p.get("speedup_vs_one") is not None]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({p["peers"] for p in points})
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=110)
    ax.plot(counts, counts, linestyle="--", color="grey", label="ideal (N x)")
    for backend in dict.fromkeys(p["backend"] for p in points):
        mine = sorted(
            (p["peers"], p["speedup_vs_one"], p.get("reached")) for p in points if p["backend"] == backend
        )
        ax.plot([n for n, _, _ in mine], [s for _, s, _ in mine], marker="o", label=backend)
        for n, s, reached in mine:
            if not reached:
                ax.annotate("<", (n, s), textcoords="offset points", xytext=(6, -4))
    ax.set_xlabel("devices")
    ax.set_ylabel(f"speed-up to {scaling['target']:g} bits/byte vs one device")
    ax.set_xticks(counts)
    step = f"{scaling['step_time_s']:g} s steps"
    ax.set_title(f"batch {scaling['batch_size']:g} per device, {step}, {scaling['rate']} links")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
