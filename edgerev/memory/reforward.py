"""Training plain (non-reversible) models under a cap: checkpoint segments (Re-forwarding, Feng & Huang).

A plain model's stages form a linear graph ``x_0 -> stage_0 -> x_1 -> ... -> x_n``. A plan keeps some
vertices and splits the chain into segments between them. A *stored* segment keeps its autograd
graph from the forward to the backward (fastest); a *checkpoint* segment keeps only its input
``x_i`` (in float32, or as an 8- or 4-bit copy) and is re-run with autograd in the backward, once,
just before its gradients are needed (``torch.utils.checkpoint`` with ``use_reentrant=False`` for
float32 inputs). During the backward of a segment the memory is what the earlier segments keep plus
the segment's own graph plus the gradient at its output, which is Re-forwarding's cost model for a
linear graph. Re-forwarding minimizes that peak; here the same segment structure is chosen to
minimize the step time under the budget, exactly, by a dynamic program over (stage, bytes kept).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from edgerev.errors import EdgerevError
from edgerev.layers.base import replaying
from edgerev.memory.planner import BudgetTooSmall
from edgerev.memory.profile import Linear
from edgerev.quantize import Quantized, dequantize, quantize

SEGMENT_MODES = ("store", "checkpoint", "store8", "store4")
_KEPT_BYTES_PER_ELEMENT = {"checkpoint": None, "store8": 1.0, "store4": 0.5}


@dataclass(frozen=True)
class Segment:
    start: int
    end: int  # exclusive
    mode: str  # store, checkpoint, store8, store4


@dataclass(frozen=True)
class StageStats:
    """Per sample of the model's batch: input bytes, bytes autograd saves; seconds as ``a + b * batch``."""

    input_bytes: float
    input_elements: float
    graph_bytes: float
    output_bytes: float
    forward_seconds: Linear
    backward_seconds: Linear


@dataclass(frozen=True)
class SegmentPlan:
    batch: int
    segments: tuple[Segment, ...]
    predicted_peak_bytes: int
    step_seconds: float

    @property
    def samples_per_second(self) -> float:
        return self.batch / self.step_seconds

    def stage_modes(self) -> list[str]:
        modes = []
        for s in self.segments:
            modes += [s.mode] * (s.end - s.start)
        return modes


def stage_stats(stages: Sequence[nn.Module], x: Tensor, repeats: int = 2) -> list[StageStats]:
    """Measure each stage on ``x`` (batch ``B``) and on its first half: bytes per sample, seconds fitted."""
    b = x.shape[0]
    if b < 2:
        raise ValueError("stage_stats needs a batch of at least 2 (seconds are fitted over two batch sizes)")
    out: list[StageStats] = []
    h = x.detach()
    for stage in stages:
        saved: dict[int, int] = {}

        def pack(t: Tensor, saved: dict[int, int] = saved) -> Tensor:
            st = t.untyped_storage()
            saved[st._cdata] = st.nbytes()
            return t

        xin = h.detach().requires_grad_()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), replaying(stage):
            y = stage(xin)
        graph = sum(n for k, n in saved.items() if k != xin.untyped_storage()._cdata)
        fwd, bwd = {}, {}
        for n in (b // 2, b):
            fwd[n], bwd[n] = _time_stage(stage, xin[:n].detach().requires_grad_(), repeats)
        out.append(StageStats(xin.numel() * xin.element_size() / b, xin.numel() / b, graph / b,
                              y.numel() * y.element_size() / b, Linear.fit(b // 2, fwd[b // 2], b, fwd[b]),
                              Linear.fit(b // 2, bwd[b // 2], b, bwd[b])))
        h = y.detach()
    return out


def _time_stage(stage: nn.Module, xin: Tensor, repeats: int) -> tuple[float, float]:
    params = [p for p in stage.parameters() if p.requires_grad]
    t_f = t_b = math.inf
    with replaying(stage):
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with torch.no_grad():
                stage(xin)
            t_f = min(t_f, time.perf_counter() - t0)
            with torch.enable_grad():
                y = stage(xin)
            gy = torch.ones_like(y)
            t0 = time.perf_counter()
            torch.autograd.grad(y, [xin, *params], gy, allow_unused=True)
            t_b = min(t_b, time.perf_counter() - t0)
    return t_f, t_b


def _segment_cost(stats: Sequence[StageStats], i: int, j: int, mode: str,
                  batch: int = 1) -> tuple[float, float, float]:
    """(bytes kept until its backward and extra bytes during it, per sample; extra seconds per step)."""
    graph = sum(s.graph_bytes for s in stats[i:j]) + stats[i].input_bytes  # the input is saved too
    if mode == "store":
        return graph, 0.0, 0.0
    per = _KEPT_BYTES_PER_ELEMENT[mode]
    kept = stats[i].input_bytes if per is None else stats[i].input_elements * per
    recompute = sum(s.forward_seconds.at(batch) for s in stats[i:j])
    if per is not None:
        recompute += 2 * batch * stats[i].input_bytes / 4e9  # quantize and dequantize, memory bound
    return kept, graph, recompute


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


class _QuantizedSegment(torch.autograd.Function):
    """A segment kept as an 8/4-bit copy of its input and re-run with autograd in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, fn, modules, bits: int, *params: Tensor) -> Tensor:
        ctx.q: Quantized = quantize(x.detach(), bits)
        ctx.fn, ctx.modules, ctx.params = fn, modules, params
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, gy: Tensor):
        xin = dequantize(ctx.q).requires_grad_()
        del ctx.q
        with torch.enable_grad(), _replaying_all(ctx.modules):
            out = ctx.fn(xin)
        grads = torch.autograd.grad(out, [xin, *ctx.params], gy, allow_unused=True)
        return (grads[0], None, None, None, *grads[1:])


@contextlib.contextmanager
def _replaying_all(modules: Sequence[nn.Module]):
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(replaying(m))
        yield


def run_segments(stages: Sequence[nn.Module], segments: Sequence[Segment], x: Tensor) -> Tensor:
    """Forward through ``stages`` as ``segments`` say (under autograd: the backward follows the plan)."""
    for seg in segments:
        part = list(stages[seg.start:seg.end])

        def fn(h: Tensor, part: list[nn.Module] = part) -> Tensor:
            for m in part:
                h = m(h)
            return h

        if seg.mode == "store" or not torch.is_grad_enabled():
            x = fn(x)
        elif seg.mode == "checkpoint":
            # the re-run must not update batch-norm running statistics a second time
            x = checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False,
                           context_fn=lambda part=part: (contextlib.nullcontext(), _replaying_all(part)))
        else:
            params = [p for m in part for p in m.parameters() if p.requires_grad]
            x = _QuantizedSegment.apply(x, fn, part, 8 if seg.mode == "store8" else 4, *params)
    return x
