"""A plan fitted to the CUDA allocator (edgerev/memory/plan/device_fit.py): the loop on constructed devices
(a planner and an allocator whose excess over the plan is known), and on a real GPU under a 400 MiB cap."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev.memory.plan.autoplan import TrainingPlan
from edgerev.memory.plan.device_fit import fit_to_device
from edgerev.memory.solve.costs import BudgetTooSmall
from tests.helpers import own_process

MiB = 2**20
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def planner(base: int, per_sample: int):
    """A planner whose step holds ``base + per_sample * micro_batch`` bytes: the largest batch under the budget."""

    def plan_at(budget: int) -> TrainingPlan:
        fitting = [b for b in BATCHES if base + per_sample * b <= budget]
        if not fitting:
            raise BudgetTooSmall(budget, base + per_sample)
        b = max(fitting)
        return TrainingPlan(b, None, None, base + per_sample * b, {})

    return plan_at


def device(budget: int, fixed: int, per_sample: int, base: int, plan_per_sample: int):
    """An allocator that holds the plan's bytes, a fixed workspace and more per sample; out of memory above the cap."""
    seen = []

    def measure(tp: TrainingPlan) -> int | None:
        real = base + plan_per_sample * tp.batch + fixed + per_sample * tp.batch
        seen.append(real)
        return None if real > budget else real

    return measure, seen


@settings(max_examples=300, deadline=None)
@given(fixed=st.integers(0, 120 * MiB), extra=st.integers(0, 400_000), per_sample=st.integers(100_000, 2 * MiB),
       base=st.integers(0, 60 * MiB))
def test_the_fitted_plan_runs_when_one_does(fixed, extra, per_sample, base):
    """Whatever the device holds beyond the plan (fixed and per sample), the plan returned runs under the cap
    whenever one of the micro-batches the rounds can reach does; each plan before it ran out of memory; the
    budget planned under only shrinks; a plan that runs at once is kept."""
    budget = 400 * MiB
    measure, seen = device(budget, fixed, extra, base, per_sample)
    runs = [b for b in BATCHES if base + (per_sample + extra) * b + fixed <= budget]
    try:
        fit = fit_to_device(planner(base, per_sample), measure, budget)
    except BudgetTooSmall as e:
        assert not runs
        assert e.budget == budget and e.smallest > base + per_sample
        return
    budgets = [f.planned_under for f in fit.fits]
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == len(budgets)
    assert all(f.measured_bytes is None for f in fit.fits[:-1])
    if fit.fitted:
        assert fit.fits[-1].measured_bytes <= budget
    else:
        assert len(fit.fits) == 6
    if seen[0] <= budget:
        assert len(fit.fits) == 1 and fit.plan.batch == fit.fits[0].micro_batch
    # each round takes an eighth of the cap off the last plan's prediction: six reach below a quarter of it
    if runs and base + per_sample * max(runs) >= budget // 4:
        assert fit.fitted


def test_the_campaign_case_fits_in_a_later_round():
    """The GTX 750 recipe's measured-profile plan on an H100: micro-batch 256 in cheaper modes as the budget falls
    (its planner fills the budget, to a floor), out of memory under the cap twice, then a plan that runs."""
    budget = 400 * MiB

    def plan_at(target: int) -> TrainingPlan:  # modes, not the micro-batch, absorb the budget
        if target < 150 * MiB:
            raise BudgetTooSmall(target, 150 * MiB)
        return TrainingPlan(256, None, None, min(target, 367 * MiB), {})

    fit = fit_to_device(plan_at, lambda tp: None if tp.predicted_peak_bytes + 110 * MiB > budget else
                        tp.predicted_peak_bytes + 110 * MiB, budget)
    assert [f.measured_bytes is None for f in fit.fits] == [True, True, False]
    assert [f.predicted_bytes for f in fit.fits] == [367 * MiB, 317 * MiB, 267 * MiB]
    assert fit.fitted and fit.summary()["device_fitted"] is True


def test_a_floor_beyond_the_device_names_the_budget_that_would_fit():
    budget = 100 * MiB
    measure, _ = device(budget, 60 * MiB, 0, 50 * MiB, 1000)
    with pytest.raises(BudgetTooSmall) as e:
        fit_to_device(planner(50 * MiB, 1000), measure, budget)
    assert e.value.budget == budget and e.value.smallest > 50 * MiB


@pytest.mark.gpu
@pytest.mark.slow  # the estimated profile runs the tracker over fake stages: over a minute for this model
@own_process
def test_the_planned_batch_trains_under_a_400_mib_cap_without_running_out_of_memory():
    """The GTX 750 recipe (RevNeXt width 32, 32x32, steps of 256) planned as the trainer does, then 20 steps at
    the planned micro-batch: not one out-of-memory retry, and the allocator's peak under the cap."""
    from edgerev.models import create_model
    from edgerev.train.cap import train_step
    from edgerev.train.config import load_config
    from edgerev.train.memory import plan_memory

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "gtx750.yaml")
    cfg = replace(cfg, memory=replace(cfg.memory, profile="estimate"))  # measuring the profile takes minutes
    torch.manual_seed(0)
    model = create_model("revnext", width=32, num_classes=10).cuda()
    try:
        planned = plan_memory(cfg, model, None, 256, torch.device("cuda"))
        micro, summary = planned.micro_batches, planned.summary
        assert summary["device_fitted"], summary["device_fit"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        torch.cuda.reset_peak_memory_stats()
        x = torch.randn(256, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (256,), device="cuda")
        retries = sum(train_step(model, optimizer, x, y, micro_batches=micro).retries for _ in range(20))
        assert retries == 0
        assert torch.cuda.max_memory_reserved() <= 400 * MiB
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
