"""scripts/probe_outer.py: its averaging rules on hand-made anchors, and one short probe end to end."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from scripts import _probe_run, probe_outer
from swarm.learning import OuterOptimizer


def _peers(count: int) -> list[OuterOptimizer]:
    """Outer optimizers (lr 1, no momentum) over small models whose anchors and steps all differ."""
    outers = []
    for index in range(count):
        torch.manual_seed(index)
        model = nn.Linear(3, 2)
        outer = OuterOptimizer(model, lr=1.0, momentum=0.0)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.1)  # the inner steps since the anchor
        outers.append(outer)
    return outers


def _models(outers: list[OuterOptimizer]) -> list[dict[str, torch.Tensor]]:
    return [outer.copy_parameters() for outer in outers]


def _mean(tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: sum(t[name] for t in tensors) / len(tensors) for name in tensors[0]}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[name], b[name], atol=1e-6) for name in a)


def test_allreduce_moves_every_anchor_by_the_mean_pseudo_gradient() -> None:
    outers = _peers(3)
    models = _models(outers)
    anchors = [{name: t.clone() for name, t in outer.anchor.items()} for outer in outers]
    _probe_run._sync(outers, probe_outer.Probe(mode="allreduce"), 1, random.Random(0))
    step = _mean([{n: a[n] - m[n] for n in a} for a, m in zip(anchors, models, strict=True)])
    for outer, anchor, model in zip(outers, anchors, models, strict=True):
        assert _close(outer.anchor, {n: anchor[n] - step[n] for n in anchor})
        assert not _close(outer.anchor, model)  # not each peer's own step: the peers' steps differ


@pytest.mark.parametrize("pull", [0.0, 1.0])
def test_a_gossip_pair_applies_its_mean_step_and_pulls_its_anchors_together(pull: float) -> None:
    outers = _peers(2)
    models = _models(outers)
    anchors = [{name: t.clone() for name, t in outer.anchor.items()} for outer in outers]
    probe = probe_outer.Probe(mode="gossip", anchor_pull=pull)
    _probe_run._sync(outers, probe, 1, random.Random(0))
    step = _mean([{n: a[n] - m[n] for n in a} for a, m in zip(anchors, models, strict=True)])
    for outer, anchor in zip(outers, anchors, strict=True):
        pulled = {n: anchor[n] + (_mean(anchors)[n] - anchor[n]) * pull for n in anchor}
        assert _close(outer.anchor, {n: pulled[n] - step[n] for n in anchor})
    # a full pull with outer lr 1 and no momentum is pairwise model averaging; without it, the anchors'
    # gap stays what it was
    assert _close(outers[0].anchor, outers[1].anchor) == (pull == 1.0)
    if pull == 1.0:
        assert _close(outers[0].anchor, _mean(models))


def test_a_short_probe_trains_and_reports_its_curve() -> None:
    probe = probe_outer.Probe(mode="gossip", peers=2, steps=20, sync_every=5, eval_every=10, eval_batches=1)
    result = probe_outer.run(probe)
    assert [point[0] for point in result["curve"]] == [10, 20]
    first, last = result["curve"][0][1], result["curve"][-1][1]
    assert last < first < 8.0  # it learns from the uniform 8 bits/byte
    assert result["steps_to_target"] is None and result["samples_to_target"] is None  # 3.6 is far off


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown mode 'ring'"):
        probe_outer.run(probe_outer.Probe(mode="ring"))


def test_a_model_exchange_is_the_pair_s_model_average_and_a_late_one_keeps_local_progress() -> None:
    outers = _peers(2)
    models = _models(outers)
    probe = probe_outer.Probe(mode="gossip", exchange="model", lag=1)
    pending: dict = {}
    _probe_run._sync(outers, probe, 1, random.Random(0), pending)
    assert set(pending) == {0, 1} and _close(outers[0].anchor, _models(outers)[0]) is False  # not yet
    later = []
    for outer in outers:  # the next round's local progress, made while the exchange runs
        params = outer.copy_parameters()
        step = {n: torch.full_like(p, 0.01) for n, p in params.items()}
        outer.load_parameters({n: p + step[n] for n, p in params.items()})
        later.append(step)
    _probe_run._sync(outers, probe, 2, random.Random(0), pending)  # lands, then the next exchange starts
    for outer, step in zip(outers, later, strict=True):
        assert _close(outer.anchor, _mean(models))  # outer lr 1: the pair's mean model
        assert _close(outer.copy_parameters(), {n: _mean(models)[n] + step[n] for n in step})


def test_the_hypercube_schedule_averages_four_models_exactly_in_two_rounds() -> None:
    outers = _peers(4)
    models = _models(outers)
    probe = probe_outer.Probe(mode="gossip", exchange="model", schedule="hypercube")
    for round_ in range(2):
        _probe_run._sync(outers, probe, round_, random.Random(0))
    assert all(_close(outer.anchor, _mean(models)) for outer in outers)
    random_pairs = _peers(4)
    for round_ in range(2):  # random matchings: some pair meets twice, and the four stay apart
        _probe_run._sync(
            random_pairs, probe_outer.Probe(mode="gossip", exchange="model"), round_, random.Random(3)
        )
    assert _probe_run.spread(random_pairs) > 1e-3


def test_scaling_rows_give_the_share_of_data_parallel_and_the_gap_to_all_reduce() -> None:
    plan = [
        ("one device", 1, None),
        ("data-parallel", 4, None),
        ("allreduce", 4, None),
        ("model, hypercube, lag 1", 4, None),
    ]
    results = [
        {
            "steps_to_target": steps,
            "samples_to_target": None,
            "final_loss": loss,
            "final_loss_averaged_model": loss,
        }
        for steps, loss in ((400, 4.0), (125, 3.6), (160, 3.8), (200, 3.9))
    ]
    rows = {row["rule"]: row for row in probe_outer.scaling_rows(plan, results)}
    assert rows["model, hypercube, lag 1"]["share_of_dataparallel"] == round(125 / 200, 3)
    assert rows["model, hypercube, lag 1"]["final_loss_gap_vs_allreduce"] == round(3.9 / 3.8 - 1, 4)
    assert rows["model, hypercube, lag 1"]["default"] is True and "default" not in rows["allreduce"]


def test_each_rule_is_compared_at_the_inner_lr_it_wants() -> None:
    """With several ``--scaling-lrs`` every rule at every N keeps its best run (fewest steps to the
    target, a missed target counting as worst), the baselines included, and the row says which lr."""
    plan = probe_outer.scaling_plan(800, 5, peers=(4,), target=4.0, lrs=(1e-3, 2e-3))
    assert {probe.lr for _, _, probe in plan} == {1e-3, 2e-3}
    steps = {("one device", 1e-3): 340, ("one device", 2e-3): 360, ("data-parallel", 1e-3): 160}
    steps |= {("data-parallel", 2e-3): 180, ("allreduce", 1e-3): 240, ("allreduce", 2e-3): 180}
    results = [
        {
            "steps_to_target": steps.get((rule, probe.lr), None if rule == "pairs" else 300),
            "samples_to_target": None,
            "final_loss": 3.9,
            "final_loss_averaged_model": 3.9,
        }
        for rule, _, probe in plan
    ]
    rows = {row["rule"]: row for row in probe_outer.scaling_rows(*probe_outer.best_per_rule(plan, results))}
    lrs = [rows[rule]["lr"] for rule in ("one device", "data-parallel", "allreduce")]
    assert lrs == [1e-3, 1e-3, 2e-3]
    assert rows["allreduce"]["share_of_dataparallel"] == round((340 / 180) / (340 / 160), 3)
    assert rows["pairs"]["steps_to_target"] is None and rows["pairs"]["share_of_dataparallel"] is None
    assert len(rows) == 2 + len(probe_outer.RULES)
