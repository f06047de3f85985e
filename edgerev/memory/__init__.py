"""Memory: what a training step holds, how it is measured, and plans that keep it under a budget.

The layout, by what imports torch and what runs:

- pure (no torch): :mod:`~edgerev.memory.costs` (cost curves, profiles, plans),
  :mod:`~edgerev.memory.knapsack` (stage modes), :mod:`~edgerev.memory.segments` (checkpoint segments);
- measurement: :mod:`~edgerev.memory.tracker` (live bytes), :mod:`~edgerev.memory.measure` (a step's
  peak, real or fake), :mod:`~edgerev.memory.profile` (per-stage costs, cached),
  :mod:`~edgerev.memory.analytic` (bytes per pixel from the structure);
- the accounting of a whole step under a recipe: :mod:`~edgerev.memory.account`;
- orchestration: :mod:`~edgerev.memory.autoplan` (floor, solve, check exactly, shrink);
- the cap: :mod:`~edgerev.memory.cap` (training steps under it).

The engine imports nothing from here; checkpoint segments run in :mod:`edgerev.checkpointing`.
Names load on first use, so importing a pure module never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgerev.lazy import lazy_attributes

_TABLE = {
    "CudaPeak": "edgerev.memory.tracker",
    "MemoryBudgetExceeded": "edgerev.memory.tracker",
    "MemoryTracker": "edgerev.memory.tracker",
}
__getattr__, __dir__ = lazy_attributes(__name__, _TABLE, globals())

if TYPE_CHECKING:
    from edgerev.memory.tracker import CudaPeak, MemoryBudgetExceeded, MemoryTracker

__all__ = ["CudaPeak", "MemoryBudgetExceeded", "MemoryTracker"]
