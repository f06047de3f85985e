"""The modes knapsack: a batch size and a mode per stage that maximize samples per second under a byte budget.

Pure (no torch): costs and a budget in, a plan out. For a batch ``B`` and modes ``m_i`` the predicted peak is

    fixed + max_i ( sum_{j<i} kept_j(B) + max(forward_i(B), backward_i(B)) )

(stage ``i``'s passes run while the earlier stages still hold what they kept), and the step time is
``sum_i seconds_i(B)``. Each stage is a group of mutually exclusive choices, so for a fixed batch this
is a multiple-choice knapsack: a dynamic program over the bytes kept so far (rounded up to a granule,
so a plan that fits the rounded problem fits the real one) finds the fastest modes exactly. The batch
size is swept around it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from edgerev.errors import EdgerevError
from edgerev.memory.solve.costs import BudgetTooSmall, ModeCost, Plan, Profile


@dataclass(frozen=True)
class Choice:
    """One option of a group, already evaluated at a batch size: bytes kept, local peak, seconds."""

    mode: str
    kept: float
    local: float
    seconds: float


def choices_at(stage: dict[str, ModeCost], batch: int) -> list[Choice]:
    return [Choice(m, c.kept.at(batch), max(c.forward.at(batch), c.backward.at(batch)), c.seconds.at(batch))
            for m, c in stage.items()]


def peak_of(groups: Sequence[Sequence[Choice]], picks: Sequence[int], fixed: float = 0.0) -> float:
    """Predicted peak of one choice per group."""
    kept, peak = 0.0, 0.0
    for group, k in zip(groups, picks):
        c = group[k]
        peak = max(peak, kept + c.local)
        kept += c.kept
    return fixed + peak


def solve(groups: Sequence[Sequence[Choice]], cap: float, granule: float) -> tuple[float, list[int]] | None:
    """Fastest choice per group with ``peak_of(...) <= cap`` on the granule-rounded problem (None: none fits).

    Dynamic program over stages; the state is the bytes kept so far, in granules (rounded up). A state
    keeps the fastest way to reach it; a choice is allowed when ``kept + local <= cap``.
    """
    if cap < 0:
        return None
    slots = int(cap // granule)

    def up(x: float) -> int:
        return int(math.ceil(x / granule - 1e-9))

    # best[k] = (seconds, picks) over states with k granules kept
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for group in groups:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for k, (t, picks) in best.items():
            for idx, c in enumerate(group):
                if k + up(c.local) > slots:
                    continue
                k2 = k + up(c.kept)
                cand = (t + c.seconds, picks + [idx])
                if k2 not in nxt or cand[0] < nxt[k2][0]:
                    nxt[k2] = cand
        if not nxt:
            return None
        # a state with more bytes kept and no less time is never better: prune it
        pruned: dict[int, tuple[float, list[int]]] = {}
        fastest = math.inf
        for k in sorted(nxt):
            if nxt[k][0] < fastest:
                pruned[k] = nxt[k]
                fastest = nxt[k][0]
        best = pruned
    return min(best.values(), key=lambda v: v[0])


def plan(profile: Profile, budget: int, batches: Sequence[int] | None = None, granules: int = 4096,
         head_bytes_per_sample: float = 0.0, _raise: bool = True,
         accumulation: tuple[int, float] | None = None) -> Plan:
    """Best plan for ``budget`` bytes over ``batches`` (default: 1, 2, 3, 4, 6, 8, ... up to 4096).

    ``accumulation``: ``(step batch, bytes)``: a micro-batch below the step's batch also holds these bytes (what
    accumulating its gradients holds beside a bare step, which the profile prices)."""
    if budget <= 0:
        raise EdgerevError(f"the budget must be positive, got {budget} bytes")
    batches = list(batches or default_batches())
    step_batch, accumulating = accumulation or (0, 0.0)
    best: Plan | None = None
    for b in batches:
        groups = [choices_at(stage, b) for stage in profile.stages]
        fixed = profile.fixed_bytes + head_bytes_per_sample * b + (accumulating if b < step_batch else 0.0)
        cap = budget - fixed
        if cap <= 0:
            continue
        found = solve(groups, cap, granule=max(cap / granules, 1.0))
        if found is None:
            continue
        seconds, picks = found
        seconds += profile.head_seconds.at(b)
        p = Plan(b, tuple(groups[i][k].mode for i, k in enumerate(picks)),
                 int(math.ceil(peak_of(groups, picks, fixed))), seconds)
        if best is None or p.samples_per_second >= best.samples_per_second:
            best = p  # on a tie the larger batch: fewer micro-batches, steadier batch statistics
    if best is None:
        if not _raise:
            raise _NoPlan
        raise BudgetTooSmall(budget, smallest_budget(profile, head_bytes_per_sample))
    return best


APPROXIMATE = frozenset({"store8", "store4"})  # modes whose gradients are approximate (edgerev.approximate)


def exact_only(profile: Profile) -> Profile:
    """``profile`` without the approximate modes: the planner's first question (a stage that had only those keeps
    them)."""
    stages = [{m: c for m, c in s.items() if m not in APPROXIMATE} or dict(s) for s in profile.stages]
    return replace(profile, stages=stages)


def smallest_budget(profile: Profile, head_bytes_per_sample: float = 0.0, *, batch: int = 1) -> int:
    """The smallest budget for which :func:`plan` finds a plan at ``batch`` (modes that minimize the peak).

    The peak is minimized exactly; the budget is then raised until the granule-rounded solver
    accepts it, so the figure an error names always works.
    """
    if batch < 1:
        raise EdgerevError(f"the batch must be at least 1, got {batch}")
    budget = _smallest_peak(profile, head_bytes_per_sample, batch)
    for _ in range(200):
        try:
            plan(profile, budget, batches=[batch], head_bytes_per_sample=head_bytes_per_sample, _raise=False)
            return budget
        except _NoPlan:
            budget = int(math.ceil(budget * (1 + 2**-10))) + 1
    return budget


class _NoPlan(Exception):
    pass


def _smallest_peak(profile: Profile, head_bytes_per_sample: float = 0.0, batch: int = 1) -> int:
    """Bytes needed by ``batch`` in the modes that minimize the peak."""
    groups = [choices_at(stage, batch) for stage in profile.stages]
    # minimize the peak: DP over kept bytes keeping the smallest running peak per state
    states: dict[float, float] = {0.0: 0.0}
    for group in groups:
        nxt: dict[float, float] = {}
        for kept, peak in states.items():
            for c in group:
                k2, p2 = kept + c.kept, max(peak, kept + c.local)
                if k2 not in nxt or p2 < nxt[k2]:
                    nxt[k2] = p2
        states = nxt
    return int(math.ceil(profile.fixed_bytes + head_bytes_per_sample * batch + min(states.values())))


def default_batches() -> list[int]:
    out, b = [1, 2, 3], 4
    while b <= 4096:
        out += [b, b * 3 // 2]
        b *= 2
    return sorted(set(out))
