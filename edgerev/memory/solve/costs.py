"""The planner's vocabulary: cost curves, per-stage mode costs, profiles, plans. Pure: no torch.

Everything here is plain numbers, so the solvers (:mod:`edgerev.memory.solve.knapsack`,
:mod:`edgerev.memory.solve.segments`) can be read, tested and run without PyTorch; measurement
(:mod:`edgerev.memory.measure.profile`) fills these types in.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from edgerev.errors import EdgerevError

# 3: estimated seconds count kernel launches; byte fits at adaptive large batches; 4: CUDA's count the fused quantizer;
# 5: a GPU's floor stages undo their gradient maps (edgerev.engine.floor_restores);
# 6: the batches a measured profile was timed at (Profile.batches)
PROFILE_VERSION = 6
#: the batches a measured profile's seconds are timed at, for plans of micro-batches this large (and every profile
#: of a layout before version 6)
TIMED_BATCHES = (16, 32)
#: what a profile's source ends with when it holds only the exact modes
EXACT_ONLY = " exact"


def profile_source(estimate: bool, exact: bool) -> str:
    """A profile's source: measured or estimated, of the exact modes only or of every mode."""
    return ("estimated" if estimate else "measured") + (EXACT_ONLY if exact else "")


class BudgetTooSmall(EdgerevError):
    """No batch size and modes fit the budget; ``smallest`` is a budget that does (always positive)."""

    def __init__(self, budget: int, smallest: int) -> None:
        super().__init__(f"a budget of {budget:,} bytes cannot train even batch 1 in the smallest modes; "
                         f"the smallest budget that fits is {smallest:,} bytes")
        self.budget, self.smallest = budget, smallest


@dataclass(frozen=True)
class Linear:
    """``intercept + slope * batch``."""

    intercept: float
    slope: float

    def at(self, batch: int) -> float:
        return self.intercept + self.slope * batch

    @staticmethod
    def fit(b1: int, v1: float, b2: int, v2: float) -> Linear:
        slope = (v2 - v1) / (b2 - b1)
        return Linear(max(v1 - slope * b1, 0.0), max(slope, 0.0))


@dataclass(frozen=True)
class Curve:
    """The smaller of a fit at small batches and a fit at large ones.

    Temporaries that the engine computes in batch slices grow with small batches and stop growing
    once a batch spans several slices: the bytes of a stage are concave in the batch.
    """

    small: Linear
    large: Linear

    def at(self, batch: int) -> float:
        return min(self.small.at(batch), self.large.at(batch))


@dataclass(frozen=True)
class ModeCost:
    """What one stage costs in one mode (bytes and seconds as functions of the batch)."""

    kept: Curve  # bytes kept from the stage's forward until its backward
    forward: Curve  # bytes live at the peak of its forward (input and output buffers included)
    backward: Curve  # bytes live at the peak of its backward (kept, activation, gradients, temporaries)
    seconds: Linear  # forward + backward


@dataclass
class Profile:
    """Costs of every stage of a model, per mode, for one input size on one device."""

    arch: str
    size: int
    device: str
    key: str
    source: str  # "measured" or "estimated", with " exact" when only the exact modes were (EXACT_ONLY)
    fixed_bytes: int  # weights, their gradients and buffers
    stages: list[dict[str, ModeCost]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    head_seconds: Linear = Linear(0.0, 0.0)
    batches: tuple[int, int] = TIMED_BATCHES  # the two batches its seconds were timed at (measured profiles)

    @property
    def every_mode(self) -> bool:
        """Every mode of every stage is here, the approximate ones too (else only the exact ones: the planner's first
        question, answered without the approximate modes' costs)."""
        return not self.source.endswith(EXACT_ONLY)

    def to_json(self) -> dict:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        return d

    @staticmethod
    def from_json(d: dict) -> Profile:
        def lin(x: dict) -> Linear:
            return Linear(**x)

        def cost(c: dict) -> ModeCost:
            curves = {k: Curve(lin(c[k]["small"]), lin(c[k]["large"])) for k in ("kept", "forward", "backward")}
            return ModeCost(**curves, seconds=lin(c["seconds"]))

        stages = [{m: cost(c) for m, c in s.items()} for s in d["stages"]]
        b1, b2 = d.get("batches", TIMED_BATCHES)
        return Profile(d["arch"], d["size"], d["device"], d["key"], d["source"], d["fixed_bytes"], stages,
                       d["names"], lin(d["head_seconds"]), (int(b1), int(b2)))


def rate(batch: int, step_seconds: float) -> float:
    """Samples per second of a plan (unbounded for a step of no measured time): one definition for both kinds."""
    return batch / step_seconds if step_seconds > 0 else math.inf


@dataclass(frozen=True)
class Plan:
    """Stage modes for an invertible body: a micro-batch, a mode per stage, its peak and step time."""

    batch: int
    modes: tuple[str, ...]
    predicted_peak_bytes: int
    step_seconds: float

    @property
    def samples_per_second(self) -> float:
        return rate(self.batch, self.step_seconds)


@dataclass(frozen=True)
class Segment:
    """Stages ``[start, end)`` of a plain model run as one checkpoint segment in ``mode``."""

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
    """Checkpoint segments for a plain body: a micro-batch, the segments, its peak and step time."""

    batch: int
    segments: tuple[Segment, ...]
    predicted_peak_bytes: int
    step_seconds: float

    @property
    def samples_per_second(self) -> float:
        return rate(self.batch, self.step_seconds)

    def stage_modes(self) -> list[str]:
        modes = []
        for s in self.segments:
            modes += [s.mode] * (s.end - s.start)
        return modes
