"""Memory: the live-bytes tracker, measurement of a training step, and the analytic model."""

from edgerev.memory.tracker import CudaPeak, MemoryBudgetExceeded, MemoryTracker

__all__ = ["CudaPeak", "MemoryBudgetExceeded", "MemoryTracker"]
