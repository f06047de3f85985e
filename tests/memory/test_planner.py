"""The planner: the knapsack against brute force, plans under budgets, byte sizes, speed, real plans, the cache."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import random

import pytest
import torch

from edgerev.engine import Mode, supported_modes
from edgerev.errors import EdgerevError
from edgerev.layers import HybridBlock
from edgerev.memory.measure import profile as profile_mod
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.peak import fake_step_peak
from edgerev.memory.measure.profile import (
    TIMED_BATCHES,
    cache_dir,
    estimate_profile,
    fixed_bytes,
    load_or_measure,
    timed_batches,
)
from edgerev.memory.plan import autoplan
from edgerev.memory.plan.autoplan import SLICE_LADDER, Proposal, plan_model, plan_training, verify, widen_slices
from edgerev.memory.solve import knapsack
from edgerev.memory.solve.costs import PROFILE_VERSION, BudgetTooSmall, Curve, Linear, ModeCost, Plan, Profile
from edgerev.memory.solve.knapsack import Choice, choices_at, exact_only, peak_of, plan, smallest_budget, solve
from edgerev.models import EngineModel, create_model
from edgerev.models.base import stem
from edgerev.sizes import parse_bytes
from tests.profiles import SMALL_RESNET, SMALL_REVNEXT, measured, recorded, small_model

MODES = ("invert", "recompute", "store", "store8", "store4")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty profile cache for this test only."""
    root = tmp_path / "profiles"
    monkeypatch.setenv("EDGEREV_CACHE", str(root))
    return root


# ---- solve: the multiple-choice knapsack -------------------------------------------------------------------------


def brute_force(groups, cap):
    """Fastest time and picks over every combination with ``peak_of <= cap`` (None: none fits)."""
    best = None
    for picks in itertools.product(*(range(len(g)) for g in groups)):
        if peak_of(groups, picks) <= cap:
            t = sum(g[k].seconds for g, k in zip(groups, picks))
            if best is None or t < best[0]:
                best = (t, list(picks))
    return best


def random_groups(r: random.Random, kept_max: int = 6, local_max: int = 12):
    """2-6 groups of 1-4 choices with small integers. A stage's local peak includes what it keeps (its forward
    peak is measured with its kept bytes alive), so ``kept <= local`` as in every measured profile."""
    groups = []
    for _ in range(r.randint(2, 6)):
        group = []
        for j in range(r.randint(1, 4)):
            kept = r.randint(0, kept_max)
            group.append(Choice(f"m{j}", float(kept), float(r.randint(kept, local_max)), float(r.randint(0, 9))))
        groups.append(group)
    return groups


@pytest.mark.parametrize("chunk", range(4))
def test_solve_matches_brute_force(chunk):
    found = infeasible = 0
    for seed in range(chunk * 200, (chunk + 1) * 200):
        r = random.Random(seed)
        groups = random_groups(r)
        # caps from infeasible (below every local peak) to loose (above any sum)
        cap = r.choice([r.randint(0, 6), r.randint(0, 30), r.randint(30, 80)])
        expected = brute_force(groups, cap)
        got = solve(groups, cap, granule=1.0)
        if expected is None:
            assert got is None, f"seed {seed}: solve found {got} where nothing fits under {cap}"
            infeasible += 1
            continue
        found += 1
        assert got is not None, f"seed {seed}: solve found nothing, brute force {expected} under {cap}"
        seconds, picks = got
        assert len(picks) == len(groups)
        assert all(0 <= k < len(g) for g, k in zip(groups, picks))
        assert peak_of(groups, picks) <= cap, f"seed {seed}"
        assert seconds == sum(g[k].seconds for g, k in zip(groups, picks))
        assert seconds == expected[0], f"seed {seed}: {seconds} != brute force {expected}"
    assert found > 50 and infeasible > 10  # the sample covers both outcomes


def test_solve_edge_cases():
    one = [[Choice("a", 1.0, 3.0, 2.0), Choice("b", 0.0, 5.0, 1.0)]]
    assert solve(one, -1.0, 1.0) is None
    assert solve(one, 2.0, 1.0) is None
    assert solve(one, 3.0, 1.0) == (2.0, [0])
    assert solve(one, 5.0, 1.0) == (1.0, [1])
    # the kept bytes of earlier groups count under later local peaks
    two = [[Choice("keep", 4.0, 4.0, 0.0), Choice("drop", 0.0, 4.0, 5.0)], [Choice("x", 0.0, 3.0, 0.0)]]
    assert solve(two, 7.0, 1.0) == (0.0, [0, 0])
    assert solve(two, 6.0, 1.0) == (5.0, [1, 0])
    assert peak_of(two, [0, 0], fixed=10.0) == 17.0


@pytest.mark.parametrize("seed", range(3))
def test_solve_with_coarse_granules_never_exceeds_the_cap(seed):
    """Rounded up to granules, the answer may be slower than the optimum, never over the cap."""
    r = random.Random(seed)
    for _ in range(150):
        groups = [[Choice(f"m{j}", k, k + r.uniform(0, 900), r.uniform(0, 1)) for j, k in
                   enumerate(r.uniform(0, 300) for _ in range(r.randint(1, 4)))] for _ in range(r.randint(2, 6))]
        cap = r.uniform(100, 4000)
        got = solve(groups, cap, granule=cap / r.choice([8, 64, 4096]))
        exact = brute_force(groups, cap)
        if got is None:
            continue
        assert exact is not None
        assert peak_of(groups, got[1]) <= cap
        assert got[0] >= exact[0] - 1e-12


def test_solve_follows_peak_of_for_the_last_group():
    groups = [[Choice("a", 0.0, 1.0, 1.0)], [Choice("b", 5.0, 1.0, 1.0)]]
    assert peak_of(groups, [0, 0]) == 1.0
    assert solve(groups, 2.0, granule=1.0) == (2.0, [0, 0])


# ---- plan on a synthetic profile ---------------------------------------------------------------------------------


def line(r: random.Random, intercept: int, slope: int) -> Linear:
    return Linear(float(r.randint(0, intercept)), float(r.randint(0, slope)))


def synthetic_profile(seed: int, fixed: int | None = None) -> Profile:
    """2-5 stages with 1-3 modes each; bytes concave in the batch (two lines), forward peak >= kept."""
    r = random.Random(seed)
    stages = []
    for _ in range(r.randint(2, 5)):
        costs = {}
        for mode in r.sample(MODES, r.randint(1, 3)):
            act = r.choice([1000, 4000, 16000])  # activation bytes per sample
            kept = line(r, 300, 3 * act)
            fwd = Linear(kept.intercept + r.randint(0, 2000), kept.slope + r.randint(act, 3 * act))
            bwd = Linear(kept.intercept + r.randint(0, 4000), kept.slope + r.randint(act, 4 * act))

            def curve(lin: Linear) -> Curve:  # past batch 16 the slope halves
                return Curve(lin, Linear(lin.intercept + 8 * lin.slope, lin.slope / 2))

            secs = Linear(r.uniform(1e-4, 1e-2), r.uniform(1e-5, 1e-3))
            costs[mode] = ModeCost(curve(kept), curve(fwd), curve(bwd), secs)
        stages.append(costs)
    fixed = r.randint(0, 200_000) if fixed is None else fixed
    return Profile("synthetic", 16, "cpu", f"seed{seed}", "measured", fixed, stages,
                   [f"stage{i}" for i in range(len(stages))], Linear(r.uniform(0, 1e-3), r.uniform(0, 1e-4)))


def check_plan(p: Plan, prof: Profile, budget: int) -> None:
    """A plan is consistent with its profile and within its budget."""
    assert p.batch >= 1
    assert len(p.modes) == len(prof.stages)
    assert all(m in stage for m, stage in zip(p.modes, prof.stages))
    groups = [choices_at(stage, p.batch) for stage in prof.stages]
    picks = [list(stage).index(m) for m, stage in zip(p.modes, prof.stages)]
    assert p.predicted_peak_bytes == math.ceil(peak_of(groups, picks, prof.fixed_bytes))
    assert p.predicted_peak_bytes <= budget
    seconds = sum(g[k].seconds for g, k in zip(groups, picks)) + prof.head_seconds.at(p.batch)
    assert p.step_seconds == pytest.approx(seconds, rel=1e-12)
    assert p.samples_per_second == pytest.approx(p.batch / seconds, rel=1e-12)


def brute_smallest(prof: Profile) -> int:
    groups = [choices_at(stage, 1) for stage in prof.stages]
    best = min(peak_of(groups, picks, prof.fixed_bytes)
               for picks in itertools.product(*(range(len(g)) for g in groups)))
    return math.ceil(best)


@pytest.mark.parametrize("seed", range(12))
def test_bigger_budgets_never_plan_slower(seed):
    prof = synthetic_profile(seed)
    low = smallest_budget(prof)
    previous = None
    for i in range(40):
        budget = int(low * 1.02 * 1.25**i)  # a little above the smallest: the rounding needs a few granules
        p = plan(prof, budget)
        check_plan(p, prof, budget)
        if previous is not None:
            assert p.samples_per_second >= previous.samples_per_second * (1 - 1e-12), (budget, previous, p)
        previous = p
    assert previous.batch > 1  # the sweep reached budgets where the batch grows


@pytest.mark.parametrize("seed", range(8))
def test_plan_is_at_least_as_fast_as_any_combination_that_fits_with_room_to_spare(seed):
    """Brute force over batches and modes: everything that fits with a margin of rounding is no faster."""
    prof = synthetic_profile(seed, fixed=10_000)
    batches = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    for factor in (1.2, 2.0, 5.0, 20.0):
        budget = int(smallest_budget(prof) * factor)
        p = plan(prof, budget, batches=batches)
        check_plan(p, prof, budget)
        for b in batches:
            cap = budget - prof.fixed_bytes
            margin = (len(prof.stages) + 2) * max(cap / 4096, 1.0)
            groups = [choices_at(stage, b) for stage in prof.stages]
            for picks in itertools.product(*(range(len(g)) for g in groups)):
                if peak_of(groups, picks, prof.fixed_bytes) <= budget - margin:
                    seconds = sum(g[k].seconds for g, k in zip(groups, picks)) + prof.head_seconds.at(b)
                    assert b / seconds <= p.samples_per_second * (1 + 1e-12), (factor, b, picks, p)


@pytest.mark.parametrize("seed", range(8))
def test_budget_too_small(seed):
    prof = synthetic_profile(seed)
    smallest = smallest_budget(prof)
    # the exact minimum peak, raised by at most the solver's granule rounding, and always accepted
    assert brute_smallest(prof) <= smallest <= brute_smallest(prof) * 1.02
    assert plan(prof, smallest).batch >= 1
    for budget in (1, prof.fixed_bytes, brute_smallest(prof) - 1):
        if budget <= 0:
            continue
        with pytest.raises(BudgetTooSmall) as info:
            plan(prof, budget)
        assert isinstance(info.value, EdgerevError)
        assert info.value.smallest == smallest and info.value.budget == budget
        assert f"{smallest:,}" in str(info.value)
        assert f"{budget:,}" in str(info.value)


def test_smallest_budget_counts_the_head():
    prof = synthetic_profile(3)
    with_head = smallest_budget(prof, head_bytes_per_sample=1000)
    assert abs(with_head - (smallest_budget(prof) + 1000)) <= 0.02 * with_head
    with pytest.raises(BudgetTooSmall) as info:
        plan(prof, brute_smallest(prof) + 500, head_bytes_per_sample=1000)
    assert info.value.smallest == with_head


@pytest.mark.parametrize("budget", [0, -5])
def test_plan_rejects_a_non_positive_budget(budget):
    with pytest.raises(EdgerevError):
        plan(synthetic_profile(0), budget)


@pytest.mark.parametrize("which", ["synthetic", "revnext", "resnet18"])
def test_the_smallest_budget_is_enough(which):
    prof = synthetic_profile(0) if which == "synthetic" else recorded(which)
    p = plan(prof, smallest_budget(prof))
    assert p.batch == 1


@pytest.mark.parametrize("which", ["synthetic", "revnext", "resnet18"])
@pytest.mark.parametrize("batch", [2, 7, 64])
def test_the_smallest_budget_at_a_batch_is_enough_and_a_tenth_less_is_not(which, batch):
    prof = synthetic_profile(0) if which == "synthetic" else recorded(which)
    least = smallest_budget(prof, head_bytes_per_sample=100, batch=batch)
    assert least > smallest_budget(prof, head_bytes_per_sample=100)
    assert plan(prof, least, batches=[batch], head_bytes_per_sample=100).batch == batch
    with pytest.raises(BudgetTooSmall):
        plan(prof, int(least * 0.9), batches=[batch], head_bytes_per_sample=100)
    with pytest.raises(EdgerevError, match="batch"):
        smallest_budget(prof, batch=0)


# ---- parse_bytes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("400MiB", 400 * 2**20),
    ("1.5GB", 1_500_000_000),
    ("2 GiB", 2 * 2**30),
    ("1000000", 1_000_000),
    ("1e6", 1_000_000),
    ("1E6", 1_000_000),
    ("400mib", 400 * 2**20),
    ("400MIB", 400 * 2**20),
    ("1.5gb", 1_500_000_000),
    ("3kb", 3000),
    ("3KiB", 3072),
    ("3k", 3072),
    ("1B", 1),
    ("7", 7),
    (" 64 MiB ", 64 * 2**20),
    (".5GiB", 2**29),
    ("2TiB", 2 * 2**40),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected
    assert isinstance(parse_bytes(text), int)


@pytest.mark.parametrize("text", ["", "abc", "12xB", "-5", "0", "-1MiB", "0.5", "0B", "MiB", "1.", "+5", "5 5", "1e-3",
                                  "12 MiBs"])
def test_parse_bytes_rejects(text):
    with pytest.raises(EdgerevError):
        parse_bytes(text)


def test_parse_bytes_rejects_an_infinite_size():
    with pytest.raises(EdgerevError):
        parse_bytes("1e400")


@pytest.mark.parametrize("text, expected", [("1.001kB", 1001), ("1.005kB", 1005), ("2.01MB", 2_010_000)])
def test_parse_bytes_decimal_fractions_are_exact(text, expected):
    assert parse_bytes(text) == expected


# ---- speed --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["revnext", "resnet18"])
def test_planner_answers_every_budget_on_the_recorded_profiles(arch):
    """The default models' profiles at 32x32 (recorded, see tests/profiles.py): a valid plan, or a refusal, for
    every budget from the floor to a terabyte. How long it takes is a benchmark's figure (benchmarks/planner.py,
    ``solve_seconds``), not a test's: a loaded machine would make it fail."""
    prof = recorded(arch)
    model = create_model(arch)
    # the recorded profile still describes the model: same stages, same modes
    assert prof.size == 32 and prof.source == "measured"
    stale = "the recorded profile no longer matches the model: record it again (see tests/profiles.py)"
    assert prof.names == [type(s).__name__ for s in model.body.stages], stale
    assert [set(s) for s in prof.stages] == [{str(m) for m in supported_modes(s)} for s in model.body.stages], stale
    low = smallest_budget(prof)
    for budget in (int(low * 1.01), 64 * 2**20, 400 * 2**20, 2**30, 16 * 2**30, 2**40):
        try:
            p = plan(prof, budget)
        except BudgetTooSmall:
            assert budget < low * 1.02, budget
            continue
        check_plan(p, prof, budget)


def test_planner_plans_a_measured_profile(cache):
    prof = measured()
    for budget in (smallest_budget(prof) * 2, 2**24, 2**30):
        check_plan(plan(prof, budget), prof, budget)


# ---- real plans ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [SMALL_REVNEXT, SMALL_RESNET], ids=["revnext", "resnet18"])
@pytest.mark.parametrize("factor", [1.1, 1.5, 4.0, 30.0])
def test_plan_model_keeps_the_measured_peak_under_the_budget(cache, spec, factor):
    prof = measured(spec)
    budget = int(smallest_budget(prof) * factor)
    torch.manual_seed(0)
    model = small_model(spec)
    mp = plan_model(model, 16, budget, profile=prof)
    assert mp.profile is prof
    check = mp.plan
    assert check.batch >= 1 and len(check.modes) == len(model.body.stages)
    assert all(m in stage for m, stage in zip(check.modes, prof.stages))
    assert check.predicted_peak_bytes <= budget
    stages = mp.stages(model)
    assert [s["mode"] for s in stages] == list(check.modes)
    assert [s["type"] for s in stages] == prof.names
    result = verify(model, check.modes, check.batch, 16, steps=1, slices=mp.slices)  # the step as planned
    measured_peak = result["measured_peak_bytes"]
    assert measured_peak <= budget, (budget, check, result)
    assert abs(check.predicted_peak_bytes - measured_peak) <= 0.1 * measured_peak, (check, result)
    assert result["measured_step_seconds"] > 0
    assert not cache.exists() or not any(cache.iterdir())  # a profile passed in is not written to the cache


def test_plan_model_accepts_the_smallest_budget_it_reports(cache):
    prof = measured()
    model = small_model()
    with pytest.raises(BudgetTooSmall) as info:
        plan_model(model, 16, 1000, profile=prof)
    mp = plan_model(model, 16, info.value.smallest, profile=prof)
    assert mp.plan.predicted_peak_bytes <= info.value.smallest


def with_seconds(prof: Profile, seed: int) -> Profile:
    """``prof`` with reproducible random seconds (measured ones vary from run to run)."""
    r = random.Random(seed)
    stages = [{m: ModeCost(c.kept, c.forward, c.backward, Linear(r.uniform(1e-4, 2e-3), r.uniform(1e-5, 2e-4)))
               for m, c in stage.items()} for stage in prof.stages]
    return Profile(prof.arch, prof.size, prof.device, prof.key, prof.source, prof.fixed_bytes, stages, prof.names,
                   prof.head_seconds)


def test_plan_model_finds_a_plan_when_one_fits(cache):
    model = small_model()
    prof = with_seconds(measured(), 0)
    defaults = tuple(str(m) for m in model.body.modes)  # stem stored, every other stage inverted
    fits = fake_step_peak(model, defaults, 1, 16)  # the exact step peak of that plan at batch 1
    budget = int(fits * 1.02)
    try:
        mp = plan_model(model, 16, budget, profile=prof)
    except BudgetTooSmall as e:
        assert e.budget == budget, f"the error names a budget of {e.budget:,} bytes, the user gave {budget:,}"
        raise
    assert mp.plan.predicted_peak_bytes <= budget


def test_plan_model_rejects_a_budget_below_the_weights(cache):
    from edgerev.memory.plan.autoplan import minimal_modes

    model = small_model()
    with pytest.raises(BudgetTooSmall) as info:
        plan_model(model, 16, 1000, profile=measured())
    # the figure named is the exact peak of batch 1 in the least-memory modes, and it is enough
    assert info.value.smallest == fake_step_peak(model, minimal_modes(model, 16), 1, 16)
    fitted = plan_model(model, 16, info.value.smallest, profile=measured())
    assert fitted.plan.predicted_peak_bytes <= info.value.smallest
    assert verify(model, fitted.plan.modes, fitted.plan.batch, 16)["measured_peak_bytes"] <= info.value.smallest


@pytest.mark.slow
def test_estimate_profile_runs_and_agrees_with_measured_bytes():
    torch.manual_seed(0)
    model = EngineModel([stem(4), HybridBlock(4)], features=4, num_classes=2, divisor=1)
    est = estimate_profile(model, 8)
    assert est.source == "estimated" and len(est.stages) == 2
    real = profile_mod.measure_profile(model, 8, batches=(1, 2), repeats=1)
    for e, m in zip(est.stages, real.stages):
        assert set(e) == set(m)
        for mode in e:
            assert (e[mode].kept, e[mode].forward, e[mode].backward) == (m[mode].kept, m[mode].forward,
                                                                        m[mode].backward)
            assert e[mode].seconds.at(1) > 0


# ---- the profile cache -------------------------------------------------------------------------------------------


def timed(prof: Profile) -> Profile:
    """``prof`` as if timed at the batches a plan of any batch asks for (:data:`TIMED_BATCHES`)."""
    return dataclasses.replace(prof, batches=TIMED_BATCHES)


class FakeMeasure:
    """Stands in for ``measure_profile``: returns a measured profile (its exact modes only, or the modes asked for, as
    the real one) and counts the calls."""

    def __init__(self, prof: Profile) -> None:
        self.prof, self.calls, self.asked = prof, 0, []

    def __call__(self, model, size, device="cpu", modes=None, exact=False, batches=TIMED_BATCHES, **kw) -> Profile:
        assert tuple(batches) == self.prof.batches, "the fake measures at its profile's batches only"
        return self._measured(model, size, device, modes, exact)

    def _measured(self, model, size, device, modes, exact) -> Profile:
        self.calls += 1
        self.asked.append("exact" if exact else "all" if modes is None else "+".join(sorted(m.value for m in modes)))
        assert size == self.prof.size and device == self.prof.device
        if exact:
            return dataclasses.replace(exact_only(self.prof), source="measured exact")
        if modes is not None:
            names = {m.value for m in modes}
            return dataclasses.replace(self.prof, stages=[{m: c for m, c in s.items() if m in names}
                                                          for s in self.prof.stages])
        return self.prof


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "here"))
    assert cache_dir() == tmp_path / "here"
    monkeypatch.delenv("EDGEREV_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "edgerev" / "profiles"


def test_load_or_measure_writes_then_reads_the_cache(cache, monkeypatch):
    prof = timed(measured())
    fake = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "measure_profile", fake)
    model = small_model()
    first = load_or_measure(model, 16)
    assert fake.calls == 1 and first is prof
    files = list(cache.glob("*.json"))
    assert len(files) == 1 and prof.key in files[0].name
    stored = json.loads(files[0].read_text())
    assert stored["version"] == PROFILE_VERSION and stored["key"] == prof.key

    def fail(*args, **kwargs):
        raise AssertionError("measured again although the cache holds the profile")

    monkeypatch.setattr(profile_mod, "measure_profile", fail)
    second = load_or_measure(small_model(), 16)  # another instance of the same architecture
    assert second == prof  # every curve survives the JSON round trip
    assert second.stages[3]["store8"].kept.at(7) == prof.stages[3]["store8"].kept.at(7)
    # another input size is another profile
    monkeypatch.setattr(profile_mod, "measure_profile", FakeMeasure(prof))
    with pytest.raises(AssertionError):
        load_or_measure(model, 32)


def test_an_estimate_is_cached_in_the_process_and_on_disk(cache, monkeypatch):
    """A daemon plans every job; the estimate of one model at one size is made once (fleet rounds paid
    a minute and more per job for it)."""
    prof = dataclasses.replace(timed(measured()), source="estimated")
    fake = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "estimate_profile", fake)
    monkeypatch.setattr(profile_mod, "_ESTIMATES", {})
    first = load_or_measure(small_model(), 16, estimate=True)
    second = load_or_measure(small_model(), 16, estimate=True)
    assert fake.calls == 1 and first == prof and second == prof and second is not first
    (path,) = cache.glob("*-estimated.json")
    monkeypatch.setattr(profile_mod, "_ESTIMATES", {})  # another process: the file answers
    assert load_or_measure(small_model(), 16, estimate=True) == prof and fake.calls == 1
    # an estimate never stands in for a measured profile
    measure = FakeMeasure(timed(measured()))
    monkeypatch.setattr(profile_mod, "measure_profile", measure)
    load_or_measure(small_model(), 16)
    assert measure.calls == 1


def test_the_exact_modes_are_measured_first_and_the_approximate_ones_only_when_asked(cache, monkeypatch):
    """The planner asks for the exact modes first; the approximate ones, as long again to measure, are measured where
    no exact plan fits, and then only they: the profile of every mode is the exact one completed, and answers both
    questions from then on."""
    prof = timed(measured())
    fake = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "measure_profile", fake)
    part = load_or_measure(small_model(), 16, exact=True)
    assert not part.every_mode and not any(knapsack.APPROXIMATE & set(s) for s in part.stages)
    assert load_or_measure(small_model(), 16, exact=True) == part and fake.asked == ["exact"]  # read back
    full = load_or_measure(small_model(), 16)
    assert fake.asked == ["exact", "store4+store8"] and full.every_mode and full.source == "measured"
    assert [{m: (c.kept, c.forward, c.backward) for m, c in s.items()} for s in full.stages] == \
        [{m: (c.kept, c.forward, c.backward) for m, c in s.items()} for s in prof.stages]
    assert sorted(p.name.removeprefix(f"RevNeXt-16-cpu-{prof.key}") for p in cache.iterdir()) == \
        ["-measured-exact.json", ".json"]
    assert load_or_measure(small_model(), 16, exact=True) == full == load_or_measure(small_model(), 16)
    assert len(fake.asked) == 2
    # a profile of every mode measured at once answers the exact question too: nothing is measured for it
    for path in cache.iterdir():
        path.unlink()
    again = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "measure_profile", again)
    assert load_or_measure(small_model(), 16) == prof == load_or_measure(small_model(), 16, exact=True)
    assert again.asked == ["all"]


def test_the_exact_and_the_approximate_modes_measured_apart_make_the_whole_profile():
    """Measured apart (the exact modes, then the approximate ones), a profile's bytes are those of one measurement of
    every mode, and ``store`` is still the fastest mode of each stage."""
    model = small_model()
    part = profile_mod.measure_profile(model, 16, batches=(4, 8), repeats=1, exact=True)
    exact = [{m.value for m in supported_modes(stage)} - knapsack.APPROXIMATE for stage in model.body.stages]
    assert part.source == "measured exact" and [set(s) for s in part.stages] == exact
    rest = profile_mod.measure_profile(model, 16, batches=(4, 8), repeats=1, modes=[Mode.STORE8, Mode.STORE4])
    whole = profile_mod.completed(part, rest)
    one = profile_mod.measure_profile(model, 16, batches=(4, 8), repeats=1)
    assert whole.source == one.source == "measured" and whole.every_mode
    assert [{m: (c.kept, c.forward, c.backward) for m, c in s.items()} for s in whole.stages] == \
        [{m: (c.kept, c.forward, c.backward) for m, c in s.items()} for s in one.stages]
    for stage in whole.stages:
        if "store" in stage:
            for b in (4, 8):
                assert stage["store"].seconds.at(b) <= min(c.seconds.at(b) for c in stage.values()) + 1e-12
    with pytest.raises(EdgerevError, match="another model"):
        profile_mod.completed(part, dataclasses.replace(rest, key="0" * 16))
    with pytest.raises(EdgerevError, match="timed at batches"):
        profile_mod.completed(part, dataclasses.replace(rest, batches=(16, 32)))


def test_a_measured_plan_measures_the_approximate_modes_only_where_no_exact_plan_fits(cache, monkeypatch):
    """Under a cap where an exact plan fits, planning measures the exact modes alone (a daemon's first job waited for
    the approximate ones too: as long again); under one where only a 4-bit copy fits, it measures those after."""
    def scaled(curve: Curve, f: float) -> Curve:
        return Curve(*(Linear(fit.intercept * f, fit.slope * f) for fit in (curve.small, curve.large)))

    # the small RevNeXt's copies made four times smaller, so that a budget fits them and no exact plan (timed at 4
    # and 8, as a plan of micro-batches up to 8 asks: FakeMeasure checks it)
    prof = dataclasses.replace(measured(), stages=[
        {m: ModeCost(*(scaled(k, 0.25) for k in (c.kept, c.forward, c.backward)), c.seconds)
         if m in knapsack.APPROXIMATE else c for m, c in stage.items()} for stage in measured().stages])
    fake = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "measure_profile", fake)
    exact_floor = smallest_budget(exact_only(prof))
    generous = plan_training(small_model(), 16, 4 * exact_floor, "cpu", max_batch=8, check=False, widen=False)
    assert fake.asked == ["exact"] and not knapsack.APPROXIMATE & set(generous.modes)
    between = (smallest_budget(prof) + exact_floor) // 2
    assert smallest_budget(prof) < between < exact_floor
    tight = plan_training(small_model(), 16, between, "cpu", max_batch=8, check=False, widen=False)
    assert fake.asked == ["exact", "store4+store8"] and knapsack.APPROXIMATE & set(tight.modes)


def test_a_profile_is_timed_at_the_batches_its_plans_run_and_measured_again_for_larger_ones(cache, monkeypatch):
    """A plan of micro-batches up to 8 has its profile timed at 4 and 8 (a quarter of the work of 16 and 32, and no
    line extrapolated down to batches it never runs); a later plan of larger batches measures it again at 16 and 32,
    and that profile then answers for every batch."""
    assert [timed_batches(b) for b in (None, 1, 2, 3, 8, 31, 32, 512)] == \
        [(16, 32), (1, 2), (1, 2), (1, 3), (4, 8), (15, 31), (16, 32), (16, 32)]
    small = FakeMeasure(measured())  # timed at 4 and 8
    monkeypatch.setattr(profile_mod, "measure_profile", small)
    assert load_or_measure(small_model(), 16, exact=True, batch=8).batches == (4, 8)
    assert load_or_measure(small_model(), 16, exact=True, batch=5).batches == (4, 8) and small.calls == 1  # read back
    large = FakeMeasure(timed(measured()))
    monkeypatch.setattr(profile_mod, "measure_profile", large)
    assert load_or_measure(small_model(), 16, exact=True, batch=64).batches == TIMED_BATCHES and large.calls == 1
    assert load_or_measure(small_model(), 16, exact=True, batch=8).batches == TIMED_BATCHES and large.calls == 1
    assert profile_mod.cached_profile(small_model(), 16, exact=True).batches == TIMED_BATCHES
    # the approximate modes are measured at the batches of the exact ones they complete
    full = load_or_measure(small_model(), 16, batch=8)
    assert full.every_mode and full.batches == TIMED_BATCHES and large.asked == ["exact", "store4+store8"]


@pytest.mark.parametrize("damage", [
    "not json at all {",
    "",
    '{"version": 1}',
    '{"version": 999, "key": "x"}',
    "stale-key",
    "bad-stages",
    b"\xff\xfe\x00garbage",
])
def test_a_damaged_cache_entry_is_measured_again(cache, monkeypatch, damage):
    prof = timed(measured())
    fake = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "measure_profile", fake)
    model = small_model()
    load_or_measure(model, 16)
    (path,) = cache.glob("*.json")
    good = json.loads(path.read_text())
    if damage == "stale-key":
        path.write_text(json.dumps({**good, "key": "0" * 16}))
    elif damage == "bad-stages":
        path.write_text(json.dumps({**good, "stages": [{"store": {"kept": 5}}]}))
    elif isinstance(damage, bytes):
        path.write_bytes(damage)
    else:
        path.write_text(damage)
    again = load_or_measure(model, 16)
    assert fake.calls == 2 and again is prof
    assert json.loads(path.read_text()) == good  # and the entry is repaired
    assert load_or_measure(model, 16) == prof and fake.calls == 2


@pytest.mark.parametrize("damage", ["[]", "null"])
def test_a_cache_entry_that_is_not_an_object_is_measured_again(cache, monkeypatch, damage):
    fake = FakeMeasure(timed(measured()))
    monkeypatch.setattr(profile_mod, "measure_profile", fake)
    model = small_model()
    load_or_measure(model, 16)
    (path,) = cache.glob("*.json")
    path.write_text(damage)
    load_or_measure(model, 16)
    assert fake.calls == 2


@pytest.mark.slow
def test_an_account_is_made_once_per_model_step_plan_and_loss(monkeypatch):
    """A daemon plans every job of the same model: the fake-tensor step behind each account runs once."""
    from edgerev.memory.measure.account import StepShape
    from edgerev.memory.plan import autoplan
    from edgerev.memory.plan.autoplan import Proposal, accounted
    from edgerev.train.continual import ContinualLoss

    monkeypatch.setattr(autoplan, "_ACCOUNTS", {})
    calls = []
    real = autoplan.account_step
    monkeypatch.setattr(autoplan, "account_step", lambda *a, **k: calls.append(a) or real(*a, **k))
    model = small_model()
    p = Proposal(2, tuple(m.value for m in model.body.modes), None, 0, 0.0)
    step = StepShape(16, 4, momentum=True)
    first = accounted(model, step, p, ContinualLoss(1.0))
    assert accounted(small_model(), step, p, ContinualLoss(1.0)) is first and len(calls) == 1
    # another step, plan, loss or set of trained weights is another account
    accounted(model, StepShape(16, 8, momentum=True), p, ContinualLoss(1.0))
    accounted(model, step, Proposal(1, p.modes, None, 0, 0.0), ContinualLoss(1.0))
    accounted(model, step, p, None)
    model.head.weight.requires_grad_(False)
    accounted(model, step, p, ContinualLoss(1.0))
    assert len(calls) == 5
    # a loss it cannot describe is accounted every time
    accounted(model, step, p, lambda *a: a[0].sum())
    accounted(model, step, p, lambda *a: a[0].sum())
    assert len(calls) == 7


@pytest.mark.parametrize("unlabeled", [0, 4], ids=["labelled", "with unlabelled views"])
@pytest.mark.parametrize("distill", [0.0, 1.0])
def test_every_loss_the_trainer_plans_with_describes_its_memory(distill, unlabeled):
    """The planner remembers an account by its loss's ``memory_key``: a loss without one is accounted again in every
    plan (the semi-supervised loss was, in every daemon job). Every loss :func:`loss_of` makes has one, and two
    losses have the same key exactly when they are made from the same settings."""
    from edgerev.memory.plan.autoplan import _loss_key
    from edgerev.train.config import ContinualConfig, RunConfig
    from edgerev.train.memory import loss_of

    def cfg(d: float, temperature: float = 2.0) -> RunConfig:
        return RunConfig(continual=ContinualConfig(distill=d, temperature=temperature))

    key = _loss_key(loss_of(cfg(distill), unlabeled))
    assert key is not None and key == _loss_key(loss_of(cfg(distill), unlabeled))
    others = {_loss_key(loss_of(cfg(d, t), u)) for d in (0.0, 1.0) for t in (2.0, 3.0) for u in (0, 4)}
    assert len(others) == 8 and key in others


def test_a_grown_head_keeps_its_bodys_profile_with_its_own_fixed_bytes(cache, monkeypatch):
    """A device that learns a class grows its head; a fleet model has more rows than a device's own: the
    stages cost the same, so the profile (a minute and more to estimate on a small CPU) is not made again,
    but the weights' bytes are the model's."""
    prof = timed(measured())
    fake = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "measure_profile", fake)
    arch, overrides = SMALL_REVNEXT
    few, many = (create_model(arch, **dict(overrides), num_classes=n) for n in (2, 40))
    first, second = load_or_measure(few, 16), load_or_measure(many, 16)
    assert fake.calls == 1 and len(list(cache.glob("*.json"))) == 1
    assert first.stages == second.stages
    assert first.fixed_bytes == fixed_bytes(few) and second.fixed_bytes == fixed_bytes(many)
    assert second.fixed_bytes - first.fixed_bytes == 2 * 4 * 38 * many.head.in_features  # weights and gradients
    # another body is another profile
    again = FakeMeasure(prof)
    monkeypatch.setattr(profile_mod, "measure_profile", again)
    load_or_measure(create_model(arch, **{**dict(overrides), "width": 4}, num_classes=2), 16)
    assert again.calls == 1


# ---- the fallback: the least-memory modes at the largest micro-batch that fits ---------------------------------------


class _Floors:
    """A solver's floors: exact modes, and the same with a 4-bit copy of the first stage (a third less per sample)."""

    def exact_floors(self):
        from edgerev.memory.plan.autoplan import Proposal

        return [Proposal(1, ("store", "invert"), None, 0, 0.0)]

    def floors(self):
        from edgerev.memory.plan.autoplan import Proposal

        return [Proposal(1, ("store4", "invert"), None, 0, 0.0)]

    def floor_seconds(self, floor):  # one candidate a group: its seconds choose nothing
        return 1.0


@pytest.mark.parametrize("budget", [950, 1000, 1100, 1199, 1200, 10**6])
def test_the_fallback_takes_the_faster_of_the_least_memory_candidates_that_fit(budget):
    """Two exact candidates (every block in floor: 100 bytes a sample, 2 s; in invert: 120 bytes, 1 s): at the largest
    micro-batch where one fits, the faster of those that fit there."""
    from edgerev.memory.measure.account import StepAccount
    from edgerev.memory.plan.autoplan import Proposal, _largest_floor

    per_sample = {"floor": 100, "invert": 120}
    seconds = {"floor": 2.0, "invert": 1.0}

    class Solver:
        def exact_floors(self):
            return [Proposal(1, ("store", m), None, 0, 0.0) for m in ("invert", "floor")]

        def floors(self):
            return self.exact_floors()

        def floor_seconds(self, p):
            return seconds[p.modes[1]]

    def exact(p):
        total = p.batch * per_sample[p.modes[1]]
        return StepAccount(0, 0, 0, 0, 0, 0, 0, 0, 0, total, p.batch, p.batch)

    floor = Proposal(1, ("store", "floor"), None, 0, 0.0)
    p, account = _largest_floor(Solver(), exact, floor, exact(floor), budget, [1, 2, 4, 8, 10])
    largest = max(b for b in (1, 2, 4, 8, 10) if b * 100 <= budget)
    fitting = [m for m in ("floor", "invert") if largest * per_sample[m] <= budget]
    assert p.batch == largest and account.total <= budget
    assert p.modes[1] == min(fitting, key=seconds.get)


@pytest.mark.parametrize("budget", [50, 99, 100, 101, 333, 1000, 3100, 3200, 10**6])
def test_the_fallback_takes_the_largest_micro_batch_that_fits_exact_modes_first(budget):
    from edgerev.memory.measure.account import StepAccount
    from edgerev.memory.plan.autoplan import Proposal, _largest_floor

    def total(p):  # 100 bytes a sample in exact modes, 67 with the 4-bit copy
        return p.batch * (67 if p.modes[0] == "store4" else 100)

    asked = []

    def exact(p):
        asked.append(p)
        return StepAccount(0, 0, 0, 0, 0, 0, 0, 0, 0, total(p), p.batch, p.batch)

    batches = list(range(1, 33))
    floor = Proposal(1, ("store4", "invert"), None, 0, 0.0)
    p, account = _largest_floor(_Floors(), exact, floor, exact(floor), budget, batches)
    asked = asked[1:]
    fits = [(b, m) for m in ("store", "store4") for b in batches if b * (67 if m == "store4" else 100) <= budget]
    if not fits:  # nothing fits at any micro-batch: the floor as it was
        assert p == floor
    else:
        best_mode = fits[0][1]
        best = max(b for b, m in fits if m == best_mode)
        assert (p.batch, p.modes[0]) == (best, best_mode)
    assert account.total == total(p)
    assert len(asked) <= 2 * 2 * 6  # doubling then halving, per group: logarithmic in the micro-batches


@pytest.mark.parametrize("seed", range(100))
def test_the_floor_is_the_least_of_micro_batch_one_and_the_whole_batch(seed):
    """Micro-batch 1 of a step of batch B holds the gradients twice; B in one micro-batch holds them once and B
    samples' activations. The floor is the least of the two for every floor's modes, whatever the sizes, found with
    few accounts where the whole batch is far above (doubling micro-batches bound it from below); under a budget,
    a floor whose account fits it."""
    from edgerev.memory.measure.account import StepAccount
    from edgerev.memory.plan.autoplan import _floor

    r = random.Random(seed)
    batch = r.choice([2, 3, 4, 8, 64, 256])
    fixed, grads = r.randint(1_000, 100_000), r.randint(1_000, 400_000)
    per_sample = {"store": r.randint(100, 200_000), "store4": r.randint(100, 100_000)}
    temps, full = r.randint(0, 400_000), r.randint(1, 4)  # temporaries grow until the slices are full

    def total(p):
        b = p.batch
        activations = per_sample[p.modes[0]] * b + temps * min(b, full)
        return fixed + (2 * grads if b < batch else grads) + activations

    asked = []

    def exact(p):
        asked.append(p.batch)
        step = total(p) - fixed
        return StepAccount(fixed, 0, 0, 0, 0, 0, 0, 0, grads, step, batch, p.batch)

    floors = _Floors().floors()
    least = min(total(replace_batch(f, b)) for f in floors for b in (1, batch))
    p, account = _floor(_Floors(), exact, batch)
    assert account.total == total(p) == least
    if batch > autoplan.WHOLE_AT_ONCE and per_sample["store4"] > grads + temps:
        # a second sample costs more than the gradients' second copy: micro-batch 2 bounds the whole batch above it
        assert batch not in asked
    budget = least + r.randint(0, 100_000)
    p, account = _floor(_Floors(), exact, batch, budget)
    assert account.total == total(p) <= budget


def test_under_a_budget_a_floor_whose_whole_batch_fits_needs_no_other_floors_account():
    """RevNeXt at 64x64, batch 8, under 61 MiB: its first exact floor held 64.1 MB at micro-batch 1 (the gradients
    twice) and 58.7 MB at the whole batch. The floor's floor and plain autograd's were accounted at micro-batch 1 in
    between (1.8 s of the 4 s this phase took); each floor's whole batch now comes right after its micro-batch 1."""
    from edgerev.memory.measure.account import StepAccount
    from edgerev.memory.plan.autoplan import Proposal, _floor

    batch, grads = 8, 1000
    per_sample = {"invert": 100, "floor": 90, "store": 300}

    class Solver:
        def exact_floors(self):
            return [Proposal(1, ("store", m), None, 0, 0.0) for m in ("invert", "floor", "store")]

        def floors(self):
            return self.exact_floors()

    asked = []

    @functools.cache  # as the planner's accounts are
    def exact(p):
        asked.append((p.modes[1], p.batch))
        step = (2 * grads if p.batch < batch else grads) + per_sample[p.modes[1]] * p.batch
        return StepAccount(0, 0, 0, 0, 0, 0, 0, 0, grads, step, batch, p.batch)

    budget = 2 * grads  # above every floor's whole batch, below every micro-batch 1
    p, account = _floor(Solver(), exact, batch, budget)
    assert (p.modes[1], p.batch, account.total) == ("invert", batch, grads + 100 * batch)
    assert asked == [("invert", 1), ("invert", batch)]


def replace_batch(p, b):
    return dataclasses.replace(p, batch=b)


# ---- widening the slices, and plans under a cap where an exact one fits ----------------------------------------------


def test_under_a_cap_an_exact_plan_fits_in_the_plan_is_exact_at_the_whole_batch():
    """Under 1.10x the lean all-``invert`` step's peak, the planner must not give up on the whole batch nor take
    4-bit copies: that step itself fits (it did both, a micro-batch of 1 with a ``store4`` stem)."""
    model = small_model(SMALL_REVNEXT)
    lean = account_step(model, StepShape(16), 32, lambda m: m.body.set_modes("invert")).total
    plan = plan_training(model, 16, int(1.10 * lean), "cuda", estimate=True, max_batch=32, check=True, batches=[32])
    assert plan.batch == 32
    assert not {"store8", "store4"} & set(plan.modes)
    assert plan.predicted_peak_bytes <= int(1.10 * lean)


def _invert_modes(model) -> tuple[str, ...]:
    """``invert`` wherever a stage supports it, ``store`` elsewhere."""
    return tuple("invert" if "invert" in {m.value for m in supported_modes(s)} else "store" for s in model.body.stages)


def _recorded_slices(monkeypatch) -> list:
    """The slices of every step the planner accounts from now on, in order."""
    accounted = []
    real = autoplan.accounted

    def recording(model, step, p, *args, **kwargs):
        accounted.append(p.slices)
        return real(model, step, p, *args, **kwargs)

    monkeypatch.setattr(autoplan, "accounted", recording)
    return accounted


def test_the_lean_slices_are_accounted_only_where_no_wider_ones_fit(monkeypatch):
    """Accounting a step costs time in proportion to its kernels, which double with every halving of the slices:
    where 2 MiB slices fit the budget, the planner never accounts the lean (1 MiB) step. The small RevNeXt at
    128x128, micro-batch 16, all ``invert``: 29.0 MB whole-batch and at 4 MiB slices, 27.0 MB at 2 MiB (and at 3 MiB:
    the same number of slices, all as large), 25.9 MB lean."""
    model = small_model(SMALL_REVNEXT)
    n = len(model.body.stages)
    modes, accounted = _invert_modes(model), _recorded_slices(monkeypatch)
    p, account = widen_slices(model, StepShape(128), Proposal(16, modes, None, 0, 0.0), 27_500_000)
    assert account.total <= 27_500_000
    assert min(b for b in p.slices if b) >= 2 * 1024 * 1024 and 0 in p.slices  # sliced only where the peak is
    assert (SLICE_LADDER[-1],) * n not in accounted
    assert len(accounted) <= 6  # the whole batch, 8, 4, 2 MiB, the mixed plan


def test_a_stage_between_two_rungs_takes_half_again_its_budget(monkeypatch):
    """The ladder halves, so a stage whose peak fits between two rungs would take the lower one: one more account
    tries every sliced stage at 1.5x its rung. The small RevNeXt at 128x128, micro-batch 16, all ``invert``: its
    odd stages peak at 29.03 MB with 4 MiB slices and under 28 MB with 3 MiB; under 28 MB they take 3 MiB, and the
    step still fits."""
    model = small_model(SMALL_REVNEXT)
    modes, accounted = _invert_modes(model), _recorded_slices(monkeypatch)
    p, account = widen_slices(model, StepShape(128), Proposal(16, modes, None, 0, 0.0), 28_000_000)
    assert account.total <= 28_000_000
    assert 3 * 1024 * 1024 in p.slices and 2 * 1024 * 1024 not in p.slices
    assert len(accounted) <= 7  # the whole batch, 8, 4, 2 MiB, the stages at 1.5x, the mixed plan


@pytest.mark.parametrize("seed", range(40))
def test_solving_apart_the_micro_batches_that_accumulate(seed):
    """Below the step's batch a micro-batch holds what accumulating costs beside a bare step: it is solved under
    that much less, its plan's peak says so, and the faster of the two groups of micro-batches wins (on a tie, the
    larger micro-batch)."""
    prof = synthetic_profile(seed)
    r = random.Random(seed)
    batches, step_batch, extra = [1, 2, 4, 8], 8, r.choice([0, 20_000, 100_000])
    budget = prof.fixed_bytes + r.randint(20_000, 400_000)

    def best(cap, group):
        try:
            return plan(prof, cap, batches=group)
        except BudgetTooSmall:
            return None
    whole, part = best(budget, [8]), best(budget - extra, [1, 2, 4]) if budget > extra else None
    if part is not None:
        part = dataclasses.replace(part, predicted_peak_bytes=part.predicted_peak_bytes + extra)
    found = [p for p in (part, whole) if p is not None]
    if not found:
        with pytest.raises(BudgetTooSmall):
            plan(prof, budget, batches=batches, accumulation=(step_batch, extra))
        return
    expected = max(found, key=lambda p: (p.samples_per_second, p.batch))
    got = plan(prof, budget, batches=batches, accumulation=(step_batch, extra))
    assert (got.batch, got.modes) == (expected.batch, expected.modes)
    assert abs(got.predicted_peak_bytes - expected.predicted_peak_bytes) <= 1 and got.predicted_peak_bytes <= budget


@pytest.mark.slow
def test_the_first_proposal_fits_where_accumulating_gradients_decides(cache, monkeypatch):
    """The engine hands back every gradient of its body at once: a micro-batch below the step's batch holds them
    beside the accumulated ones. Priced, the first proposal fits; unpriced (as before), the solver proposed a
    micro-batch whose account was over the cap, then planned again."""
    model = small_model(SMALL_REVNEXT)
    shape = StepShape(32, batch=8, momentum=True)
    budget = int(account_step(model, shape, 8, lambda m: m.body.set_modes("invert")).total * 1.02)
    body_grads = sum(p.numel() * 4 for p in model.body.parameters())

    def proposals(priced: bool) -> tuple[list, object]:
        accounts = []
        real = autoplan.widen_slices

        def spy(m, step, p, cap, loss_fn):
            wide, account = real(m, step, p, cap, loss_fn)
            accounts.append((p.batch, account.total <= cap))
            return wide, account
        with monkeypatch.context() as mp:
            mp.setattr(autoplan, "widen_slices", spy)
            if not priced:
                mp.setattr(autoplan._ModesSolver, "accumulation_bytes", lambda self: 0)
            tp = plan_training(model, 32, budget, "cpu", estimate=True, max_batch=8, step=shape, check=True)
        return accounts, tp

    assert autoplan._ModesSolver(model, 32, "cpu", None, True).accumulation_bytes() == body_grads
    accounts, tp = proposals(True)
    assert accounts == [(tp.batch, True)] and tp.predicted_peak_bytes <= budget
    unpriced, _ = proposals(False)
    assert not unpriced[0][1], unpriced  # the old question: a micro-batch that did not fit, asked first


def test_the_floor_check_accounts_no_more_floors_than_it_needs():
    """Whether a budget is below the floor needs only the first floor that fits under it, exact ones first; where
    none fits, all of them (the least is the smallest budget the refusal names)."""
    from types import SimpleNamespace

    first, second = Proposal(1, ("floor",), None, 0, 0.0), Proposal(1, ("invert",), None, 0, 0.0)
    approx = Proposal(1, ("store4",), None, 0, 0.0)
    totals = {first: 100, second: 95, approx: 80}

    class Floors:
        def exact_floors(self):
            return [first, second]

        def floors(self):
            return [approx]

    asked = []

    def account(p):
        asked.append(p)
        return SimpleNamespace(total=totals[p], gradients=0, step_bytes=0)

    assert autoplan._floor(Floors(), account, None, 120)[0] == first and asked == [first]
    asked.clear()
    assert autoplan._floor(Floors(), account, None, 90)[0] == approx and asked == [first, second, approx]
    asked.clear()
    assert autoplan._floor(Floors(), account, None, 50)[0] == approx and asked[-1] == approx  # none fits: the least
    asked.clear()
    assert autoplan._floor(Floors(), account, None)[0] == approx and asked == [approx]  # the floor itself


# ---- floor's way on the device planned for ---------------------------------------------------------------------


def test_a_plan_runs_floor_the_way_of_the_device_it_is_made_for(cache):
    """A plan for CUDA made on this CPU accounts its floor stages the GPU's way (the chains' gradient maps undone,
    ``Execution.floor_restore``) and sets that way on the model it is applied to, so the peak it reports is that of
    the step the GPU runs; a plan for the CPU holds the CPU's way, by batch slices. At 32x32, batch 16, the two
    ways' steps differ in their peaks (the lean slices hold the whole batch: by slices, every layer's activation
    of it)."""
    model = small_model()
    model.set_modes("floor")
    modes = tuple(str(m) for m in model.body.modes)
    size, batch = 32, 16
    restoring = fake_step_peak(model, modes, batch, size, floor_restore=True)
    slicing = fake_step_peak(model, modes, batch, size, floor_restore=False)
    assert restoring < slicing
    for device, budget in (("cuda", int(restoring * 1.01)), ("cpu", int(slicing * 1.5))):
        tp = plan_training(small_model(), size, budget, device, estimate=True, check=True, batches=[batch],
                           widen=False)
        assert tp.floor_restore is (device == "cuda")
        assert device == "cpu" or "floor" in tp.modes  # under the GPU's floor, some stage runs it
        run = small_model()
        tp.apply(run)
        assert run.body.execution.floor_restore is tp.floor_restore
        assert account_step(run, StepShape(size), tp.batch, tp.apply).total == tp.predicted_peak_bytes <= budget
