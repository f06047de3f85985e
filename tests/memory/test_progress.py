"""The planner names its phases once planning has taken a while: a clock injected, never a sleep."""

from __future__ import annotations

import torch
from torch import nn

from edgerev.memory.plan.autoplan import plan_training
from edgerev.memory.plan.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_reported_from_the_threshold_on_with_the_seconds_so_far():
    clock, lines = Clock(), []
    p = Progress(lines.append, after=2.0, clock=clock)
    p.phase("accounting the smallest step")
    clock.now += 1.9
    p.step("estimating stage", 0, 3)
    assert lines == []  # a plan that answers within the threshold says nothing
    clock.now += 0.1
    p.step("estimating stage", 1, 3)
    clock.now += 5.4
    p.phase("solving for the fastest plan (round 1)")
    assert lines == ["planning: estimating stage 2/3 (2 s so far)",
                     "planning: solving for the fastest plan (round 1) (7 s so far)"]


def test_without_a_sink_nothing_is_reported():
    clock = Clock()
    p = Progress(None, after=0.0, clock=clock)
    clock.now += 60
    p.phase("anything")  # no sink: nothing to call, nothing raised


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def test_the_planner_names_each_phase_in_order():
    lines: list[str] = []
    plan_training(small_cnn(), 16, 64 * 2**20, progress=Progress(lines.append, after=0.0))
    phases = [line.removeprefix("planning: ").rsplit(" (", 1)[0] for line in lines]
    assert phases[:3] == ["capturing the model's graph", "accounting the smallest step",
                          "measuring the chain's pieces"], phases
    pieces = [p for p in phases if p.startswith("measuring piece ")]
    assert pieces and pieces[-1] == f"measuring piece {len(pieces)}/{len(pieces)}"
    assert phases[3 + len(pieces)] == "solving for the fastest plan (round 1)", phases
