"""Checkpoint segments for plain (non-reversible) models (Re-forwarding, Feng & Huang). Pure: no torch.

A plain model's stages form a linear graph ``x_0 -> stage_0 -> x_1 -> ... -> x_n``. A plan keeps some
vertices and splits the chain into segments between them. A *stored* segment keeps its autograd
graph from the forward to the backward (fastest); a *checkpoint* segment keeps only its input
``x_i`` and is re-run with autograd in the backward, once, just before its gradients are needed
(``torch.utils.checkpoint`` with ``use_reentrant=False``); a *store8*/*store4* segment keeps its
graph with every saved activation as an 8- or 4-bit copy (:mod:`edgerev.approximate`), re-running
nothing. During the backward of a segment the memory is what the earlier segments keep plus
the segment's own graph plus the gradient at its output, which is Re-forwarding's cost model for a
linear graph. Re-forwarding minimizes that peak; here the same segment structure is chosen to
minimize the step time under the budget, exactly, by a dynamic program over (stage, bytes kept).

The segments run in :mod:`edgerev.checkpointing` (beside the engine); the per-stage statistics come
from :func:`edgerev.memory.measure.profile.stage_stats`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from edgerev.errors import EdgerevError
from edgerev.memory.solve.costs import BudgetTooSmall, Segment, SegmentPlan, StageStats

SEGMENT_MODES = ("store", "checkpoint", "store8", "store4")
EXACT_SEGMENT_MODES = ("store", "checkpoint")  # exact gradients: what a plan takes wherever it fits
#: bytes an approximate segment keeps per float32 byte of its graph (the 1-d statistics stay exact: rounding)
_APPROXIMATE_FRACTION = {"store8": 1 / 4, "store4": 1 / 8}


def _segment_cost(stats: Sequence[StageStats], i: int, j: int, mode: str,
                  batch: int = 1) -> tuple[float, float, float]:
    """(bytes kept until its backward and extra bytes during it, per sample; extra seconds per step)."""
    graph = sum(s.graph_bytes for s in stats[i:j]) + stats[i].input_bytes  # the input is saved too
    if mode == "store":
        return graph, 0.0, 0.0
    if mode == "checkpoint":
        return stats[i].input_bytes, graph, sum(s.forward_seconds.at(batch) for s in stats[i:j])
    # one layer's copy at a time comes back in float32 during the backward
    extra = max(s.input_bytes for s in stats[i:j])
    return graph * _APPROXIMATE_FRACTION[mode], extra, 2 * batch * graph / 4e9  # quantize, dequantize: memory bound


def solve_segments(stats: Sequence[StageStats], cap_per_sample: float, modes: Sequence[str] = SEGMENT_MODES,
                   granules: int = 1024, batch: int = 1) -> tuple[float, list[Segment]] | None:
    """Fastest segmentation whose predicted peak per sample stays under ``cap_per_sample``.

    State: (stages covered, bytes kept so far in granules, rounded up). A segment ``[i, j)`` is allowed
    when the bytes kept before it, plus what it holds during its backward, plus the gradient at its
    output and its input, fit the cap.
    """
    n = len(stats)
    granule = max(cap_per_sample / granules, 1e-9)

    def up(v: float) -> int:
        return int(math.ceil(v / granule - 1e-9))

    slots = int(cap_per_sample // granule)
    best: list[dict[int, tuple[float, list[Segment]]]] = [dict() for _ in range(n + 1)]
    best[0][0] = (0.0, [])
    for i in range(n):
        for k, (t, segs) in sorted(best[i].items()):
            for j in range(i + 1, n + 1):
                for mode in modes:
                    kept, extra, secs = _segment_cost(stats, i, j, mode, batch)
                    grads = stats[j - 1].output_bytes + stats[i].input_bytes
                    if k + up(kept + extra + grads) > slots:
                        continue
                    k2 = k + up(kept)
                    cand = (t + secs, [*segs, Segment(i, j, mode)])
                    if k2 not in best[j] or cand[0] < best[j][k2][0]:
                        best[j][k2] = cand
        for j in range(i + 1, n + 1):  # more bytes kept and no less time is never better
            fastest, pruned = math.inf, {}
            for k in sorted(best[j]):
                if best[j][k][0] < fastest:
                    pruned[k], fastest = best[j][k], best[j][k][0]
            best[j] = pruned
    if not best[n]:
        return None
    return min(best[n].values(), key=lambda v: v[0])


def plan_segments(stats: Sequence[StageStats], budget: int, fixed_bytes: int,
                  batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512),
                  modes: Sequence[str] = SEGMENT_MODES) -> SegmentPlan:
    """Sweep the batch; per batch, the fastest segmentation that fits ``budget`` bytes."""
    if budget <= 0:
        raise EdgerevError(f"the budget must be positive, got {budget} bytes")
    best: SegmentPlan | None = None
    for b in batches:
        cap = (budget - fixed_bytes) / b
        if cap <= 0:
            continue
        found = solve_segments(stats, cap, modes, batch=b)
        if found is None:
            continue
        secs, segs = found
        step = secs + sum(s.forward_seconds.at(b) + s.backward_seconds.at(b) for s in stats)
        peak = fixed_bytes + b * predicted_peak(stats, segs)
        p = SegmentPlan(b, tuple(segs), int(math.ceil(peak)), step)
        if best is None or p.samples_per_second > best.samples_per_second:
            best = p
    if best is None:
        smallest = fixed_bytes + min(predicted_peak(stats, s) for s in _minimal_segmentations(stats))
        raise BudgetTooSmall(budget, int(math.ceil(smallest)))
    return best


def predicted_peak(stats: Sequence[StageStats], segments: Sequence[Segment]) -> float:
    """Bytes per sample at the peak of a step with ``segments``."""
    kept, peak = 0.0, 0.0
    for s in segments:
        k, extra, _ = _segment_cost(stats, s.start, s.end, s.mode)
        peak = max(peak, kept + k + extra + stats[s.end - 1].output_bytes + stats[s.start].input_bytes)
        kept += k
    return peak


def _minimal_segmentations(stats: Sequence[StageStats]) -> list[list[Segment]]:
    n = len(stats)
    return [[Segment(i, i + 1, "store4") for i in range(n)], [Segment(0, n, "store4")]]
