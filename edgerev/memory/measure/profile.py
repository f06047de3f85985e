"""Per-stage costs, measured: each engine mode (bytes kept, bytes live during its passes, seconds), and
the statistics of a plain model's stages for checkpoint segments (:func:`stage_stats`; estimated,
:func:`estimate_stage_stats`).

Each stage is run on its own, inside a one-stage engine sequence, at two batch sizes: bytes and
seconds are fitted as ``intercept + slope * batch`` (per sample of the *model's* batch, so batch
pooling is accounted for). Bytes come from the live-tensor tracker, seconds from the wall clock
after a warm-up step, at the batches the plans run (:func:`timed_batches`). A profile is cached per (model, input
size, device) as JSON and reused by plans of batches it was timed for.
Without measurement (``estimate=True``) bytes come from the same tracker under fake tensors and
seconds from the same fake run's FLOPs and kernel launches at nominal rates (a step of many small kernels
is slow on any device: on a GPU each launch costs about as much as a small kernel's arithmetic): the
planner can answer before anything has run. Stages of the same structure and input shape are run once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from edgerev._torchapi import shadowed, storage_key
from edgerev.engine import Execution, InvertibleSequence, Mode, engine_body, floor_restores, supported_modes
from edgerev.errors import EdgerevError
from edgerev.layers.base import LEAN_SLICE_BYTES, chunk_budget, replaying
from edgerev.memory.measure.tracker import MemoryTracker
from edgerev.memory.measure.workspaces import active_key
from edgerev.memory.solve.costs import (
    PROFILE_VERSION,
    TIMED_BATCHES,
    Curve,
    Linear,
    ModeCost,
    Profile,
    StageStats,
    profile_source,
)
from edgerev.models.spec import model_spec
from edgerev.quantize import LAUNCHES, fusing

# seconds per FLOP used by estimates, per device type (a measured profile replaces them): about 20 GFLOP/s on a
# small CPU, 2 TFLOP/s on a small GPU (a GTX 750 peaks at 1.1, a Jetson Orin's at several)
NOMINAL_SECONDS_PER_FLOP = {"cpu": 1 / 20e9, "cuda": 1 / 2e12}
# seconds per kernel launch (an op that is not a view or an allocation) used by estimates: an eager op costs
# some microseconds of dispatch on a CPU and 10-15 us of launch on a GPU (14.1 us fitted on an H200)
NOMINAL_SECONDS_PER_KERNEL = 10e-6


def nominal_seconds(flops: float, kernels: int, device: str = "cpu") -> float:
    """Estimated seconds of ``flops`` FLOPs in ``kernels`` kernel launches on a device of type ``device``."""
    per_flop = NOMINAL_SECONDS_PER_FLOP.get(torch.device(device).type, NOMINAL_SECONDS_PER_FLOP["cpu"])
    return flops * per_flop + kernels * NOMINAL_SECONDS_PER_KERNEL


def model_key(model: nn.Module, size: int, device: str) -> str:
    """Identity of a profile: architecture, the printed structure of everything but the classifier
    (``head``), input size, device and torch.

    The head is left out because no stage's cost depends on it: a model that grows its head for a new
    class, or a fleet model with more classes than the device's own, keeps the profile of its body. What
    the head does change, the weights' bytes, is the model's own (:func:`fixed_bytes`, set on every load).
    """
    body = "|".join(f"{name}={child!r}" for name, child in model.named_children() if name != "head")
    text = f"{type(model).__name__}|{body}|{size}|{device}|{torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """``$EDGEREV_CACHE`` or the user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    root = os.environ.get("EDGEREV_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgerev" / "profiles"


def _body(model: nn.Module) -> InvertibleSequence:
    body = engine_body(model)
    if body is None:
        raise EdgerevError(f"cannot analyse {type(model).__name__}: it has no engine body (an InvertibleSequence)")
    return body


def stage_inputs(model: nn.Module, size: int, device: str | torch.device = "cpu") -> list[tuple[int, ...]]:
    """Input shape of every stage for a batch of one image (dim 0 is the batch multiplier): a forward of a copy
    without data, shapes only (``device`` is where the model is; the copy runs nowhere)."""
    body = _body(model)
    shapes: dict[int, tuple[int, ...]] = {}
    def record(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            shapes.setdefault(i, tuple(args[0].shape))

        return hook

    def forward(copy: nn.Module) -> None:
        hooks = [s.register_forward_pre_hook(record(i)) for i, s in enumerate(_body(copy).stages)]
        copy.eval()
        with torch.no_grad():
            copy(torch.zeros(1, model_spec(model).in_channels, size, size))
        for h in hooks:
            h.remove()

    shadowed(model, forward)
    return [shapes[i] for i in range(len(body.stages))]


def _nbytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def _run(stage: nn.Module, mode: Mode, shape: tuple[int, ...], batch: int, first: bool, device: str | None,
         track: bool, restore: bool) -> tuple[float, float, float, float]:
    """(kept, forward peak, backward peak, seconds) of one forward+backward of a one-stage sequence (``device``
    None: the default device, the meta device under :func:`edgerev._torchapi.shadowed`), a floor stage run the way
    ``restore`` says (the way of the device profiled, :func:`edgerev.engine.floor_restores`)."""
    seq = InvertibleSequence([stage], modes=[mode], pool=None)
    seq.set_execution(Execution(owns_buffers=True, floor_restore=restore))
    n = shape[0] * batch
    tracker = MemoryTracker() if track else contextlib.nullcontext()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with tracker:
        x = torch.randn(n, *shape[1:], device=device)
        if not first:  # a non-leaf input, as inside a model: nothing but the stage may keep it alive
            x = x + torch.zeros((), device=device, requires_grad=True)
        out = seq(x)
        del x
        if track:
            kept, fwd = tracker.current - _nbytes(out), tracker.peak
            tracker.reset_peak()
        gy = torch.randn_like(out)
        out.backward(gy)
        bwd = tracker.peak if track else 0.0
        del out, gy
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return (kept, fwd, bwd, seconds) if track else (0.0, 0.0, 0.0, seconds)


SMALL_BATCHES = (1, 2)  # the byte fit at small batches (run on fake tensors)
LARGE_BATCH_LIMIT = 64  # the large fit's first batch at most


def large_batches(shape: tuple[int, ...], element_size: int = 4) -> tuple[int, int]:
    """The batches of the byte fit at large batches: from the batch at which every slice of the stage's
    temporaries is full, so its bytes grow by the activations alone (the lean 1 MiB budget; the narrowest
    slice the layers take is a quarter of the stage's input row), and one sample more. Past that batch the bytes
    are a line in the batch, so any two batches give the same fit (RevNeXt's stages at 64x64 and 224x224: the same
    slopes through ``k, k + 1`` as through ``k, 2k``), and a larger one would only cost fake ops: a run's ops grow
    with its slices."""
    per_sample = max(1, math.prod(shape) * element_size)  # bytes of the stage input per sample of the model
    k = min(LARGE_BATCH_LIMIT, max(2, math.ceil(4 * LEAN_SLICE_BYTES / per_sample)))
    return k, k + 1


def stage_key(stage: nn.Module, shape: tuple[int, ...], first: bool) -> tuple:
    """What a stage's costs depend on: its structure, its input's shape per sample, whether it is the first (its
    input a leaf), which of its weights train and their types, which of its modules are in training mode. Two stages
    of one key cost the same bytes in every mode, and the same seconds but for the clock's noise."""
    return (repr(stage), shape, first, tuple((p.requires_grad, p.dtype) for p in stage.parameters()),
            tuple(m.training for m in stage.modules()))


_BYTES: dict[tuple, tuple[Curve, Curve, Curve]] = {}  # (stage key, mode, lean slice) -> byte fits, this process
_ESTIMATED_SECONDS: dict[tuple, Linear] = {}  # (stage key, mode, device type) -> estimated seconds, this process


def _bytes_curves(stage: nn.Module, mode: Mode, shape: tuple[int, ...], first: bool, device: str
                  ) -> tuple[Curve, Curve, Curve]:
    """Byte fits from fake-tensor runs at the lean slices, a floor stage run the way ``device`` runs it: exact bytes,
    nothing allocated, any batch. Remembered for this process by :func:`stage_key`: the planner asks for the exact
    modes first and for all of them later, a model repeats its blocks, and a daemon plans each job of the same model
    again."""
    restore = floor_restores(device)
    key = (stage_key(stage, shape, first), mode, LEAN_SLICE_BYTES, restore if mode is Mode.FLOOR else None,
           active_key())  # a CUDA device's libraries counted in them, or none
    if key not in _BYTES:
        _BYTES[key] = _fit_bytes(stage, mode, shape, first, restore)
    return _BYTES[key]


def _fit_bytes(stage: nn.Module, mode: Mode, shape: tuple[int, ...], first: bool,
               restore: bool) -> tuple[Curve, Curve, Curve]:
    fits = []
    large = large_batches(shape)
    # slices full from the second batch on (two slices at least): one fit serves both (a line through batches 2
    # and 3 lies above the bytes of batch 1, whose one slice is the whole batch)
    pairs = (large,) if large[0] == 2 else (SMALL_BATCHES, large)
    for b1, b2 in pairs:
        with chunk_budget(LEAN_SLICE_BYTES):
            r1, r2 = shadowed(stage, functools.partial(_runs, mode=mode, shape=shape, batches=(b1, b2), first=first,
                                                       restore=restore))
        fits.append([Linear.fit(b1, r1[k], b2, r2[k]) for k in range(3)])
    # the stage's own weight gradients are counted once for the whole model (Profile.fixed_bytes)
    own = float(sum(p.numel() * p.element_size() for p in stage.parameters()))
    for fit in fits:
        fit[2] = Linear(max(fit[2].intercept - own, 0.0), fit[2].slope)
    small, large = fits[0], fits[-1]
    return tuple(Curve(small[k], large[k]) for k in range(3))


def _runs(stage: nn.Module, mode: Mode, shape: tuple[int, ...], batches: tuple[int, ...], first: bool,
          restore: bool) -> list[tuple]:
    """:func:`_run` tracked at each of ``batches``, on the default device (meta under ``shadowed``)."""
    return [_run(stage, mode, shape, b, first, None, True, restore) for b in batches]


def _measure_mode(stage: nn.Module, mode: Mode, shape: tuple[int, ...], first: bool, device: str,
                  batches: tuple[int, int], repeats: int) -> ModeCost:
    kept, fwd, bwd = _bytes_curves(stage, mode, shape, first, device)
    secs = {}
    restore = floor_restores(device)
    for b in batches:
        _run(stage, mode, shape, b, first, device, False, restore)  # warm-up
        secs[b] = min(_run(stage, mode, shape, b, first, device, False, restore)[3] for _ in range(repeats))
    b1, b2 = batches
    return ModeCost(kept, fwd, bwd, Linear.fit(b1, secs[b1], b2, secs[b2]))


def timed_batches(batch: int | None = None) -> tuple[int, int]:
    """The two batches a profile is timed at for plans whose micro-batches are at most ``batch``:
    :data:`TIMED_BATCHES`, or for a smaller step ``batch`` and half of it. A step of batch 8 is timed at 4 and 8
    (a quarter of the work, a minute less for RevNeXt at 64x64 on a small CPU) and its line is not extrapolated to
    batches it never runs; ``None``: any batch."""
    if batch is None or batch >= TIMED_BATCHES[1]:
        return TIMED_BATCHES
    b = max(2, batch)
    return b // 2, b


def measure_profile(model: nn.Module, size: int, device: str = "cpu", batches: tuple[int, int] = TIMED_BATCHES,
                    repeats: int = 3, modes: list[Mode] | None = None, exact: bool = False,
                    progress: Callable[[int, int], None] | None = None) -> Profile:
    """Measure every stage in every mode it supports (or in ``modes``) on this machine: its seconds at each of
    ``batches`` the least of ``repeats`` runs after a warm-up.

    A stage of the same :func:`stage_key` as one measured before (RevNeXt's blocks within a level) takes its costs:
    the same bytes, and seconds that differ only by the clock's noise. ``exact``: the exact modes only, as
    :func:`estimate_profile` (the planner's first question; :func:`load_or_measure` measures the approximate ones
    only where no exact plan fits, :func:`completed`). ``progress(i, n)``: stage ``i`` of ``n`` begins."""
    body = _body(model)
    shapes = stage_inputs(model, size, device)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # profiling steps move BN statistics
    model.train()
    stages, names = [], []
    seen: dict[tuple, dict[str, ModeCost]] = {}
    try:
        for i, (stage, shape) in enumerate(zip(body.stages, shapes)):
            if progress is not None:
                progress(i, len(body.stages))
            key = stage_key(stage, shape, i == 0)
            if key not in seen:
                costs = {}
                for m in supported_modes(stage):
                    if (modes is None or m in modes) and not (exact and m.bits is not None):
                        costs[m.value] = _measure_mode(stage, m, shape, i == 0, device, batches, repeats)
                seen[key] = _store_is_fastest(costs, batches)
                stage.zero_grad(set_to_none=True)
            stages.append(dict(seen[key]))
            names.append(type(stage).__name__)
    finally:
        model.load_state_dict(state)
    return Profile(type(model).__name__, size, device, model_key(model, size, device),
                   profile_source(False, exact), fixed_bytes(model), stages, names, batches=tuple(batches))


def completed(part: Profile, rest: Profile) -> Profile:
    """A profile of every mode from ``part``'s exact modes and ``rest``'s approximate ones (measured later, by
    ``measure_profile(modes=...)`` at ``part``'s batches): ``store`` stays the fastest, as in one measurement."""
    if (part.key, len(part.stages)) != (rest.key, len(rest.stages)):
        raise EdgerevError(f"cannot complete the profile {part.key} with the profile {rest.key}: another model")
    if part.batches != rest.batches:
        raise EdgerevError(f"cannot complete a profile timed at batches {part.batches} with one timed at "
                           f"{rest.batches}")
    stages = [_store_is_fastest({**a, **b}, part.batches) for a, b in zip(part.stages, rest.stages)]
    return replace(part, source=profile_source(False, False), stages=stages)


def _store_is_fastest(costs: dict[str, ModeCost], batches: tuple[int, int]) -> dict[str, ModeCost]:
    """``store`` does no work beyond plain autograd, so no other mode of the stage is faster.

    Timings of small stages differ by less than their noise; where the measurement at a timed batch
    says otherwise, ``store`` gets the faster time there (and the line through those two points), so
    the planner never trades memory for nothing.
    """
    if "store" not in costs:
        return costs
    store = costs["store"]
    b1, b2 = batches
    t1 = min(c.seconds.at(b1) for c in costs.values())
    t2 = min(c.seconds.at(b2) for c in costs.values())
    if t1 >= store.seconds.at(b1) and t2 >= store.seconds.at(b2):
        return costs
    costs = dict(costs)
    costs["store"] = ModeCost(store.kept, store.forward, store.backward, Linear.fit(b1, t1, b2, t2))
    return costs


def fixed_bytes(model: nn.Module) -> int:
    """Bytes that live through a whole step whatever the plan: weights, their gradients, buffers."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 2 * params + buffers


def estimate_profile(model: nn.Module, size: int, device: str = "cpu", exact: bool = False,
                     progress: Callable[[int, int], None] | None = None) -> Profile:
    """Bytes from fake-tensor runs of each stage, seconds from the FLOPs and kernel launches of a fake run at
    nominal rates (:func:`estimated_seconds`). A stage of the same :func:`stage_key` as one already estimated
    (RevNeXt's blocks within a level), in this profile or an earlier one of this process, takes its costs.
    ``exact``: the exact modes only (the planner's first question: ``store8``/``store4`` are asked for only where no
    exact plan fits, and then only they are estimated). ``progress(i, n)``: stage ``i`` of ``n`` begins."""
    body = _body(model)
    # the shapes from a forward where the model is (a CUDA model's forward on a CPU image fails); the rest
    # runs on copies of its stages without data (meta)
    shapes = stage_inputs(model, size, next(model.parameters()).device)
    stages, names = [], []
    for i, (stage, shape) in enumerate(zip(body.stages, shapes)):
        if progress is not None:
            progress(i, len(body.stages))
        stages.append({m.value: ModeCost(*_bytes_curves(stage, m, shape, i == 0, device),
                                         estimated_seconds(stage, m, shape, i == 0, device))
                       for m in supported_modes(stage) if not (exact and m.bits is not None)})
        names.append(type(stage).__name__)
    return Profile(type(model).__name__, size, device, model_key(model, size, device),
                   profile_source(True, exact), fixed_bytes(model), stages, names)


def estimated_seconds(stage: nn.Module, mode: Mode, shape: tuple[int, ...], first: bool, device: str = "cpu"
                      ) -> Linear:
    """Seconds of a forward and backward of ``stage`` in ``mode`` as a line in the batch: its FLOPs and its kernel
    launches, counted on fake tensors at batches 1 and 2 with whole-batch slices (the planner widens a plan's
    slices as far as its budget allows, :func:`edgerev.memory.plan.autoplan.widen_slices`), at the nominal rates of a
    ``device`` (:func:`nominal_seconds`). Remembered for this process by :func:`stage_key`."""
    key = (stage_key(stage, shape, first), mode, torch.device(device).type)
    if key not in _ESTIMATED_SECONDS:
        _ESTIMATED_SECONDS[key] = _count_seconds(stage, mode, shape, first, device)
    return _ESTIMATED_SECONDS[key]


def _count(stage: nn.Module, mode: Mode, shape: tuple[int, ...], batch: int, first: bool,
           restore: bool) -> FlopCounter:
    counter = FlopCounter()
    with counter:
        _run(stage, mode, shape, batch, first, None, False, restore)
    return counter


def _count_seconds(stage: nn.Module, mode: Mode, shape: tuple[int, ...], first: bool, device: str) -> Linear:
    seconds = {}
    # the quantizer as the device runs it: fused on CUDA (a few launches a tensor), eager elsewhere
    for b in SMALL_BATCHES:
        with chunk_budget(0), fusing(torch.device(device).type == "cuda"):
            counter = shadowed(stage, functools.partial(_count, mode=mode, shape=shape, batch=b, first=first,
                                                        restore=floor_restores(device)))
        seconds[b] = nominal_seconds(counter.total, counter.kernels, device)
    b1, b2 = SMALL_BATCHES
    return Linear.fit(b1, seconds[b1], b2, seconds[b2])


#: ATen ops that launch no kernel: views are counted out by their schema, these by name
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                       "detach", "alias", "_local_scalar_dense"})


def launches_kernel(func) -> bool:
    """Does this ATen op launch a kernel on a device? Everything but views, allocations and aliases (and reading a
    scalar back, which is a host synchronisation rather than a kernel: :class:`FlopCounter` counts it apart)."""
    return func.namespace == "aten" and not func.is_view and func._overloadpacket.__name__ not in NO_KERNEL


def launches(func) -> int:
    """Kernels an op launches on a device: one for an ATen op that launches any (:func:`launches_kernel`), what
    :data:`edgerev.quantize.LAUNCHES` says for a fused edgerev operator, none for the rest."""
    if func.namespace == "edgerev":
        return LAUNCHES.get(func._overloadpacket.__name__, 1)
    return int(launches_kernel(func))


class FlopCounter(TorchDispatchMode):
    """FLOPs of every op PyTorch has a formula for (convolutions, matrix products), by shapes only, and the kernel
    launches of all ops (:func:`launches_kernel`): on any device, meta and fake tensors included.

    ``torch.utils.flop_counter.FlopCounterMode`` also tracks modules with hooks, which breaks the
    engine's own ``autograd.grad`` calls inside its backward; this counts ops and nothing else.

    Attributes:
        total: FLOPs.
        kernels: ops that launch a kernel.
        syncs: values read back to the host (``.item()``, a tensor's truth value): each waits for the device.
        by_op: kernel launches per op name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.kernels = 0
        self.syncs = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        name = func._overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.syncs += 1
        else:
            n = launches(func)
            if n:
                self.kernels += n
                self.by_op[name] = self.by_op.get(name, 0) + n
        return out


def _path(model: nn.Module, size: int, device: str, root: Path, kind: str) -> Path:
    """Where the profile of (model, size, device) of ``kind`` is cached under ``root``."""
    name = f"{type(model).__name__}-{size}-{device}-{model_key(model, size, device)}"
    return root / (f"{name}.json" if kind == "measured" else f"{name}-{kind.replace(' ', '-')}.json")


def _read(path: Path, key: str, kind: str) -> Profile | None:
    """The profile cached at ``path``, or None (none there, another version, model or kind, or damaged)."""
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        if isinstance(d, dict) and d.get("version") == PROFILE_VERSION and d.get("key") == key \
                and d.get("source", kind) == kind:
            return Profile.from_json(d)
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        pass  # a damaged cache entry is measured again
    return None


def _cached(model: nn.Module, size: int, device: str, root: Path, estimate: bool,
            exact: bool = False, batch: int | None = None) -> tuple[Path, Profile | None]:
    """Where a profile of (model, size, device) of the kind asked for is cached under ``root``, and the cached
    profile that answers: one of every mode answers a question for the exact modes too, and a measured one answers
    for micro-batches up to ``batch`` when it was timed that far (:func:`timed_batches`; ``None``: any batch)."""
    key = model_key(model, size, device)
    kinds = tuple(profile_source(estimate, e) for e in ((False, True) if exact else (False,)))
    needed = timed_batches(batch)[1]
    for kind in kinds:
        prof = _read(_path(model, size, device, root, kind), key, kind)
        if prof is not None and (estimate or prof.batches[1] >= needed):
            return _path(model, size, device, root, kinds[-1]), prof
    return _path(model, size, device, root, kinds[-1]), None


def cached_profile(model: nn.Module, size: int, device: str = "cpu", cache: Path | None = None,
                   estimate: bool = False, exact: bool = False, batch: int | None = None) -> Profile | None:
    """The profile :func:`load_or_measure` would reuse, or None; nothing is measured (``edgerev doctor``)."""
    prof = _cached(model, size, device, cache or cache_dir(), estimate, exact, batch)[1]
    return None if prof is None else _own_bytes(prof, model)


def load_or_measure(model: nn.Module, size: int, device: str = "cpu", cache: Path | None = None,
                    estimate: bool = False, exact: bool = False,
                    progress: Callable[[int, int], None] | None = None, batch: int | None = None) -> Profile:
    """The cached profile for (model, size, device), measuring it (or estimating it) the first time.

    ``exact``: the exact modes are enough (a profile of every mode answers too): the planner asks for the
    approximate ones only where no exact plan fits, and they take as long again as the exact ones. A profile of
    every mode asked for where the exact modes were measured before measures only the approximate ones.

    ``batch``: the largest micro-batch the plan may run (``None``: any). A measured profile is timed at
    :func:`timed_batches` of it, and one timed at smaller batches than that is measured again.

    Estimates are cached too (their own file, and in this process): an estimate depends only on the
    model's structure, the input size and torch, yet runs every stage in every mode under fake tensors,
    a minute and more on a small CPU; a daemon or a fleet round that plans each job of the same model
    would pay it every job.
    """
    key = (model_key(model, size, device), exact, active_key())
    if estimate and key in _ESTIMATES:
        return _own_bytes(copy.deepcopy(_ESTIMATES[key]), model)
    root = cache or cache_dir()
    path, prof = _cached(model, size, device, root, estimate, exact, batch)
    if prof is None:
        part = None if estimate or exact else _cached(model, size, device, root, False, True, batch)[1]
        if estimate:
            prof = estimate_profile(model, size, device, exact=exact, progress=progress)
        elif part is not None:  # the exact modes measured by an earlier plan: the approximate ones now
            approximate = [m for m in Mode if m.bits is not None]
            prof = completed(part, measure_profile(model, size, device, batches=part.batches, modes=approximate,
                                                   progress=progress))
        else:
            prof = measure_profile(model, size, device, batches=timed_batches(batch), exact=exact,
                                   progress=progress)
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(prof.to_json()))
            tmp.replace(path)
        except OSError:
            if not estimate:
                raise
            # an estimate is cheap to redo: a read-only or full cache only costs the next process the time
    if estimate:
        _ESTIMATES[key] = copy.deepcopy(prof)
    return _own_bytes(prof, model)


def _own_bytes(prof: Profile, model: nn.Module) -> Profile:
    """``prof`` with ``model``'s fixed bytes: a profile is shared by models whose heads differ (:func:`model_key`)."""
    own = fixed_bytes(model)
    return prof if prof.fixed_bytes == own else replace(prof, fixed_bytes=own)


_ESTIMATES: dict[tuple[str, bool, int], Profile] = {}  # (model key, exact modes only, libraries) -> estimated profile


# ---- plain models: per-stage statistics for checkpoint segments (edgerev.memory.solve.segments) ----


def stage_stats(stages: Sequence[nn.Module], x: Tensor, repeats: int = 2,
                progress: Callable[[int, int], None] | None = None) -> list[StageStats]:
    """Measure each stage on ``x`` (batch ``B``) and on its first half: bytes per sample, seconds fitted.
    ``progress(i, n)``: stage ``i`` of ``n`` begins."""
    b = x.shape[0]
    if b < 2:
        raise ValueError("stage_stats needs a batch of at least 2 (seconds are fitted over two batch sizes)")
    out: list[StageStats] = []
    h = x.detach()
    for i, stage in enumerate(stages):
        if progress is not None:
            progress(i, len(stages))
        xin = h.detach().requires_grad_()
        y, graph = _saving_forward(stage, xin)
        fwd, bwd = {}, {}
        for n in (b // 2, b):
            fwd[n], bwd[n] = _time_stage(stage, xin[:n].detach().requires_grad_(), repeats)
        out.append(StageStats(xin.numel() * xin.element_size() / b, xin.numel() / b, graph / b,
                              y.numel() * y.element_size() / b, Linear.fit(b // 2, fwd[b // 2], b, fwd[b]),
                              Linear.fit(b // 2, bwd[b // 2], b, bwd[b])))
        h = y.detach()
    return out


def estimate_stage_stats(stages: Sequence[nn.Module], x: Tensor, device: str = "cpu",
                         progress: Callable[[int, int], None] | None = None) -> list[StageStats]:
    """:func:`stage_stats` without running anything: each stage on a copy without data
    (:func:`edgerev._torchapi.shadowed`) at ``x``'s batch ``B`` and at half of it, its bytes per sample from the
    tensors autograd saves at ``B``, its seconds from the FLOPs and kernel launches of the same runs at a
    ``device``'s nominal rates (:func:`nominal_seconds`), as :func:`estimate_profile` prices an engine stage. Only
    ``x``'s shape and dtype are read."""
    b = x.shape[0]
    if b < 2:
        raise ValueError("estimate_stage_stats needs a batch of at least 2 (seconds are fitted over two batch sizes)")
    out: list[StageStats] = []
    shape, dtype = tuple(x.shape), x.dtype
    for i, stage in enumerate(stages):
        if progress is not None:
            progress(i, len(stages))
        runs = {n: shadowed(stage, functools.partial(_count_stage, shape=(n, *shape[1:]), dtype=dtype))
                for n in (b // 2, b)}
        graph, y_shape, y_dtype = runs[b][2:]
        elements = math.prod(shape[1:])
        fwd = {n: nominal_seconds(r[0].total, r[0].kernels, device) for n, r in runs.items()}
        bwd = {n: nominal_seconds(r[1].total, r[1].kernels, device) for n, r in runs.items()}
        out.append(StageStats(elements * dtype.itemsize, elements, graph / b,
                              math.prod(y_shape[1:]) * y_dtype.itemsize, Linear.fit(b // 2, fwd[b // 2], b, fwd[b]),
                              Linear.fit(b // 2, bwd[b // 2], b, bwd[b])))
        shape, dtype = y_shape, y_dtype
    return out


def _count_stage(stage: nn.Module, shape: tuple[int, ...], dtype: torch.dtype
                 ) -> tuple[FlopCounter, FlopCounter, int, tuple[int, ...], torch.dtype]:
    """One forward and backward of ``stage`` on an input of ``shape`` made where it runs (under
    :func:`edgerev._torchapi.shadowed`): the forward's and the backward's counters, the bytes autograd saved
    beside the input, and the output's shape and dtype."""
    xin = torch.empty(shape, dtype=dtype).requires_grad_()
    params = [p for p in stage.parameters() if p.requires_grad]
    forward, backward = FlopCounter(), FlopCounter()
    with forward:
        y, graph = _saving_forward(stage, xin)
    gy = torch.ones_like(y)
    with backward:
        torch.autograd.grad(y, [xin, *params], gy, allow_unused=True)
    return forward, backward, graph, tuple(y.shape), y.dtype


def _saving_forward(stage: nn.Module, xin: Tensor) -> tuple[Tensor, int]:
    """``stage(xin)`` with its graph, its running statistics left alone (:func:`replaying`), and the bytes of the
    distinct storages autograd saved for the backward beside ``xin``'s."""
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), replaying(stage):
        y = stage(xin)
    return y, sum(n for k, n in saved.items() if k != storage_key(xin))


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
