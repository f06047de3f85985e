"""Memory: what a training step holds, how it is measured, and plans that keep it under a budget.

Four rooms, each importing only from those before it (``tests/test_imports.py`` holds the order):

- :mod:`~edgerev.memory.solve`, pure (no torch): :mod:`~.solve.costs` (cost curves, profiles, plans),
  :mod:`~.solve.knapsack` (stage modes), :mod:`~.solve.segments` (checkpoint segments);
- :mod:`~edgerev.memory.measure`, what a step holds, on real or fake tensors: :mod:`~.measure.tracker` (live
  bytes), :mod:`~.measure.microbatch` (the step's micro-batch loop, which the trainer runs too),
  :mod:`~.measure.account` (the one accounting of a whole step under a recipe), :mod:`~.measure.peak` (a step's
  peak), :mod:`~.measure.profile` (per-stage costs, cached), :mod:`~.measure.analytic` (bytes per pixel from the
  structure);
- :mod:`~edgerev.memory.graph`, beside measurement: any classifier captured as a chain of pieces, which the
  planner cuts into checkpoint segments;
- :mod:`~edgerev.memory.plan`: :mod:`~.plan.autoplan` (floor, solve, check exactly, shrink),
  :mod:`~.plan.device_fit` (a plan fitted to the CUDA allocator by real steps under the cap).

What runs a step is training's: the step under the cap (:mod:`edgerev.train.cap`) and the choice of what trains
(:mod:`edgerev.train.trainable`). The engine imports nothing from here; checkpoint segments run in
:mod:`edgerev.checkpointing`. Nothing here imports :mod:`edgerev.train` or :mod:`edgerev.export`. Names load on
first use, so importing a pure module never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgerev.lazy import lazy_attributes

_TABLE = {
    "CudaPeak": "edgerev.memory.measure.tracker",
    "MemoryBudgetExceeded": "edgerev.memory.measure.tracker",
    "MemoryTracker": "edgerev.memory.measure.tracker",
}
__getattr__, __dir__ = lazy_attributes(__name__, _TABLE, globals())

if TYPE_CHECKING:
    from edgerev.memory.measure.tracker import CudaPeak, MemoryBudgetExceeded, MemoryTracker

__all__ = ["CudaPeak", "MemoryBudgetExceeded", "MemoryTracker"]
