"""One accounting of a training step, held to its promises over a grid of recipes.

For every registry model (tiny widths), sizes 32 and 64, distillation on and off, replay on and off:

- a budget below the floor is refused at start, before anything is profiled, with one line naming
  the floor (a positive number of bytes) and the budget given;
- the floor named in that line trains when given back: the trainer's plan is accepted and the
  trainer's own capped steps run under it without a retry, the tracker verifying the first;
- one byte less is refused, naming the same floor;
- no message shows a zero or negative budget.

The plans are checked on fake tensors and the steps run for real on CPU. Size 32 covers every
invariant for every model and recipe; size 64 and the whole planner at the floor (profiling, solving,
shrinking) are ``slow``.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from edgerev.memory.measure import profile as profile_mod
from edgerev.memory.plan.autoplan import floor_plan
from edgerev.memory.solve.costs import BudgetTooSmall
from edgerev.models import create_model, list_models
from edgerev.train.cap import CpuCap, train_step
from edgerev.train.config import ContinualConfig, DataConfig, MemoryConfig, ModelConfig, RunConfig, TrainConfig
from edgerev.train.memory import loss_of, plan_memory, step_shape

TINY = {
    "revnext": {"width": 8, "blocks": (1, 1, 1, 1, 1)},
    "layerwise": {"width": 8, "layers": (1, 1, 1, 1, 1)},
    "revnet": {"width": 8, "blocks": (1, 1, 1, 1)},
    "irevnet": {"width": 8, "blocks": (1, 1, 1)},
    "resnet18": {"width": 8, "blocks": (1, 1, 1, 1)},
}
BATCH = 12  # the recipe's batch; replay fills it, without replay the new data holds 5 samples
NEW_ONLY = 5
CLASSES, OLD_CLASSES = 3, 2
FLOOR = re.compile(r"the smallest budget that fits is ([0-9,]+) bytes")


def test_the_grid_covers_the_registry():
    assert sorted(TINY) == sorted(list_models())


def recipe(arch: str, size: int, distill: bool, replay: bool, budget: int) -> RunConfig:
    return RunConfig(model=ModelConfig(arch, args=dict(TINY[arch])), data=DataConfig(size=size),
                     train=TrainConfig(batch=BATCH),
                     memory=MemoryConfig(budget=budget, profile="estimate"),
                     continual=ContinualConfig(replay=100 if replay else 0, distill=1.0 if distill else 0.0))


def setup(arch: str, distill: bool):
    torch.manual_seed(0)
    model = create_model(arch, **TINY[arch], num_classes=CLASSES)
    teacher = None
    if distill:
        teacher = copy.deepcopy(create_model(arch, **TINY[arch], num_classes=OLD_CLASSES)).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    return model, teacher


def refused(cfg: RunConfig, model, teacher, batch: int) -> tuple[str, int]:
    with pytest.raises(BudgetTooSmall) as info:
        plan_memory(cfg, model, teacher, batch, torch.device("cpu"))
    line = str(info.value)
    assert "\n" not in line
    assert f"a budget of {int(cfg.memory.budget):,} bytes" in line, line
    found = FLOOR.search(line)
    assert found, line
    floor = int(found.group(1).replace(",", ""))
    assert floor > 0 and info.value.smallest == floor
    assert not re.search(r"(-[0-9]|\b0 bytes)", line), line
    return line, floor


def capped_steps(model, teacher, cfg, batch: int, micro: int, cap, steps: int = 2) -> None:
    """The trainer's own step (:func:`train_step`), for real, under ``cap``: never a retry."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    loss_fn = loss_of(cfg)
    g = torch.Generator().manual_seed(1)
    size = cfg.data.size
    for _ in range(steps):
        x = torch.randn(batch, 3, size, size, generator=g)
        target = (torch.randint(0, CLASSES, (batch,), generator=g),)
        if teacher is not None:
            with torch.no_grad():
                target += (teacher(x),)
        result = train_step(model, optimizer, x, target, micro_batches=micro, loss_fn=loss_fn, cap=cap)
        assert result.retries == 0, "the plan accepted at start needed a smaller micro-batch"
        assert result.micro_batches == micro
    assert cap.verified_steps == 1 and cap.trusted_steps == steps - 1
    assert cap.baseline < cap.peak <= cap.budget, "the verified step's tracked peak"


#: (arch, size, distill, replay): every combination of the step's terms at 32x32 for every model; at 64x64 the one
#: with all terms (a teacher and its logits, replay's full batch), per model: the size changes each term's bytes
#: and the slices, not which terms there are (the three other combinations at 64 took 40 s of a run's workers)
FLOOR_GRID = [(arch, size, distill, replay) for arch in sorted(TINY) for size in (32, 64)
              for distill in (False, True) for replay in (False, True) if size == 32 or (distill and replay)]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "size", "distill", "replay"), FLOOR_GRID,
                         ids=[f"{a}-{s}-{'distill' if d else 'ce'}-{'replay' if r else 'new-only'}"
                              for a, s, d, r in FLOOR_GRID])
def test_the_floor_is_refused_below_and_trains_at(arch, size, distill, replay, monkeypatch, tmp_path):
    """Refused below the floor before any profiling; the floor's plan trains under a cap of exactly the floor."""
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path))
    model, teacher = setup(arch, distill)
    batch = BATCH if replay else NEW_ONLY

    def no_profiling(*a, **k):
        raise AssertionError("a budget below the floor must be refused before anything is profiled")

    with monkeypatch.context() as m:
        for name in ("measure_profile", "estimate_profile", "stage_stats"):
            m.setattr(profile_mod, name, no_profiling)
        _, floor = refused(recipe(arch, size, distill, replay, 1), model, teacher, batch)
        _, again = refused(recipe(arch, size, distill, replay, floor - 1), model, teacher, batch)
    assert again == floor

    cfg = recipe(arch, size, distill, replay, floor)
    plan, account = floor_plan(model, step_shape(cfg, model, teacher, batch), loss_of(cfg))
    assert account.total == floor and account.micro_batch == 1
    assert account.optimizer > 0 and account.batch_input == batch * 3 * size * size * 4
    assert (account.teacher > 0) == distill and (account.teacher_logits > 0) == distill
    plan.apply(model)
    capped_steps(model, teacher, cfg, batch, batch, CpuCap(floor, account.baseline))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["revnext", "resnet18"])
def test_the_trainer_plans_at_the_floor_and_trains(arch, monkeypatch, tmp_path):
    """The whole planner at the floor (profile, solve, check, shrink), then the trainer's steps under its cap."""
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path))
    model, teacher = setup(arch, True)
    _, floor = refused(recipe(arch, 32, True, True, 1), model, teacher, BATCH)
    cfg = recipe(arch, 32, True, True, floor)
    planned = plan_memory(cfg, model, teacher, BATCH, torch.device("cpu"))
    micro, cap, summary = planned.micro_batches, planned.cap, planned.summary
    assert cap is not None and cap.budget == floor
    assert summary["account"]["total"] == summary["predicted_peak_bytes"] <= floor
    capped_steps(model, teacher, cfg, BATCH, micro, cap)


@pytest.mark.slow
def test_a_run_below_the_floor_stops_at_start_and_writes_nothing(tmp_path):
    from edgerev.config import from_dict
    from edgerev.train.trainer import train

    cfg = from_dict(RunConfig, {"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}},
                                "data": {"size": 16, "train": {"samples": 40, "num_classes": 3}},
                                "train": {"epochs": 1, "batch": 8}, "memory": {"budget": "100KiB"}})
    with pytest.raises(BudgetTooSmall) as info:
        train(cfg, tmp_path / "run", progress=False)
    assert "a budget of 102,400 bytes" in str(info.value) and FLOOR.search(str(info.value))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value, message", [
    ("lots", "memory.budget: cannot read 'lots' as a size in bytes"),
    (-1, "memory.budget: a size in bytes must be at least one byte"),
    ("-1MiB", "memory.budget: a size in bytes must be positive"),
    (0, "memory.budget: a size in bytes must be at least one byte"),
    ("0B", "memory.budget: a size in bytes must be at least one byte"),
    ("1e18", "memory.budget: '1e18' is more bytes than any device has"),
    (True, "memory.budget: expected a size in bytes"),
])
def test_a_bad_budget_is_one_line_naming_the_key(value, message):
    from edgerev.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, {"memory": {"budget": value}})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_budget_is_read_once_into_an_int():
    from edgerev.config import from_dict, to_dict

    cfg = from_dict(RunConfig, {"memory": {"budget": "1.5GB"}})
    assert cfg.memory.budget == 1_500_000_000 and isinstance(cfg.memory.budget, int)
    assert to_dict(cfg)["memory"]["budget"] == 1_500_000_000 and type(to_dict(cfg)["memory"]["budget"]) is int
    assert from_dict(RunConfig, to_dict(cfg)) == cfg
