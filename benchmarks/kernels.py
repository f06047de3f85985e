"""Kernel ops per training step, counted on the ``meta`` device: no GPU needed, CUDA's op sequence.

For every registry model, every engine mode its stages support and plain autograd, and every input size:

* ``ops``: the ATen ops one training step (forward, cross-entropy, backward) dispatches, each one a kernel
  launch on a GPU; views and allocations are left out (``edgerev.memory.measure.profile.NO_KERNEL``), host reads
  of a tensor (``_local_scalar_dense``) are ``host_syncs``, counted apart; ``store8``/``store4``'s quantizer is
  counted as CUDA runs it, fused, each fused operator at its launches (``edgerev.quantize.LAUNCHES``;
  ``--eager-quantizer``: the eager kernels a CPU runs); ``floor`` the way a GPU runs it, undoing its chains'
  gradient maps (``Execution.floor_restore``; a CPU runs it by batch slices);
* ``flops``: the step's FLOPs by ``torch.utils.flop_counter``'s formulas (convolutions, matrix products);
* ``peak_bytes``: the step's predicted peak (``edgerev.memory.measure.account.account_step`` on fake tensors, the one
  accounting the planner and the trainer use);
* each figure against plain autograd's for the same model, batch and size.

``planned``: the step the planner sets up for ``--plan-model`` (revnext) at batch ``--plan-batch`` (32) under
caps that are multiples of a lean mode's peak (``--caps``, default 1.10x all-``invert`` and 1.10x
all-``floor``): ``plan_training(model, size, cap, "cuda", estimate=True, max_batch=32, check=True,
batches=[32])`` then ``plan.apply(model)``: the paper's step (micro-batch 32) planned for a GPU (whose nominal
rates make launches dear; on a CPU's, arithmetic dominates and a micro-batch of 1 or 2 in ``store`` can be the
fastest there), accounted on fake tensors, in a fresh process with an empty profile cache; the ops and peak of
the step it set up, and the wall and CPU seconds planning took.

A bare step reads its value checks at once, which meta tensors cannot, so ``ops`` leaves them out (four
kernels each, two a step). ``host_syncs`` is counted on the trainer's own step (``train_step``: value checks
folded into the loss, read once at its end) for real, on the CPU, for the same model and mode at batch 2,
32x32, and with it ``trainer_extra_ops``, what that step launches beyond the bare one (the optimizer's update in
torch's multi-tensor SGD, CUDA's default; the batch-norm statistics saved before the step; the value checks): a
few, whatever the number of parameters.

Every measurement runs in a process of its own (``--jobs`` at a time, the dearest first) under a limit of CPU
seconds (``--cpu-seconds``; ``--plan-cpu-seconds`` for planning, whose target is 30): one that overruns it is
recorded as such and the rest goes on. CPU seconds, not wall seconds, so that a loaded machine measures alike.

    PYTHONPATH=. python benchmarks/kernels.py --out results/kernels.json
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import multiprocessing
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json

from edgerev.memory.measure.profile import NO_KERNEL, FlopCounter

ROOT = Path(__file__).resolve().parent.parent
NOT_KERNELS = NO_KERNEL  # ops that launch no kernel: edgerev's one list (views are told by ``func.is_view``)
SYNCS = frozenset({"_local_scalar_dense", "item"})  # a device-to-host read: the host waits for the device
PHASES = ("forward", "loss", "backward")
# a killed task cuts the dearest modes: they start first, the cheap ones fill in beside them
COST = {"floor": 6, "store4": 5, "store8": 5, "invert": 4, "recompute": 2, "store": 1, "plain": 1}


class KernelCounter(FlopCounter):
    """:class:`edgerev.memory.measure.profile.FlopCounter` (the one rule of what launches a kernel, FLOPs and host
    reads) with its kernel launches split by phase.

    Attributes:
        phase: the phase the next ops are counted in (set by the caller).
        ops: kernel ops per phase; ``by_name``: kernel ops per op name; ``syncs``: host reads; ``flops``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = PHASES[0]
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.kernels
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.ops[self.phase] += self.kernels - before
        return out

    @property
    def flops(self) -> int:
        return self.total

    @property
    def by_name(self) -> collections.Counter[str]:
        return collections.Counter(self.by_op)


def build(name: str, overrides: dict | None = None) -> torch.nn.Module:
    """Registry model ``name`` on the CPU, in training mode, its weights seeded."""
    from edgerev import create_model

    torch.manual_seed(0)
    return create_model(name, **(overrides or {})).train()


def configure(model: torch.nn.Module, mode: str) -> None:
    """Run ``model`` in ``mode``: ``plain`` (autograd, the reference), or one engine mode for every stage that
    supports it (the others keep their default), as ``model.set_modes`` does; ``floor`` the way a GPU runs it
    (``Execution.floor_restore``, where the source tree has it), wherever the step runs or is accounted."""
    import dataclasses

    from edgerev.engine import Execution, InvertibleSequence

    gpu_way = {"floor_restore": True} if "floor_restore" in {f.name for f in dataclasses.fields(Execution)} else {}
    for seq in (m for m in model.modules() if isinstance(m, InvertibleSequence)):  # as ``edgerev.plain`` does
        seq.set_execution(dataclasses.replace(seq.execution, plain=mode == "plain", **gpu_way))
    if mode != "plain":
        model.set_modes(mode)


def engine_modes(model: torch.nn.Module) -> list[str]:
    """The engine modes at least one stage of ``model`` supports, in the engine's order."""
    from edgerev.engine import Mode, supported_modes

    have = {m for s in model.body.stages for m in supported_modes(s)}
    return [m.value for m in Mode if m in have]


def quantizer(device: str):
    """The ``store8``/``store4`` quantizer as CUDA runs it: on the meta device its fused operators (counted at
    their launches, ``edgerev.quantize.LAUNCHES``) unless ``EAGER_QUANTIZER``; elsewhere the library's choice. A
    source tree without the fused path counts its eager kernels."""
    import contextlib

    q = importlib.import_module("edgerev.quantize")
    if device != "meta" or not hasattr(q, "fusing"):
        return contextlib.nullcontext()
    return q.fusing(not EAGER_QUANTIZER)


EAGER_QUANTIZER = False  # --eager-quantizer: count the eager quantizer's kernels on meta (what a CPU runs)


def count_step(model: torch.nn.Module, batch: int, size: int, device: str = "meta") -> KernelCounter:
    """The ops of one training step of ``model`` as it is set up (modes, plan), on ``device``.

    ``model`` is moved to ``device`` (the meta device by default: ops dispatch, nothing computes; the quantizer
    as CUDA runs it, :func:`quantizer`)."""
    from edgerev.models.spec import model_spec

    spec = model_spec(model)
    model.to(device).train()
    model.zero_grad(set_to_none=True)
    x = torch.randn(batch, spec.in_channels, size, size, device=device)
    y = torch.randint(0, spec.num_classes, (batch,), device=device)
    counter = KernelCounter()
    with counter, quantizer(device):
        logits = model(x)
        counter.phase = "loss"
        loss = F.cross_entropy(logits, y)
        counter.phase = "backward"
        loss.backward()
    return counter


def predicted_peak(model: torch.nn.Module, batch: int, size: int, apply: Callable[[torch.nn.Module], None]) -> int:
    """Peak bytes of one bare training step at ``batch`` with ``apply``'s setup, on fake tensors."""
    from edgerev.memory.measure.account import StepShape, account_step

    return account_step(model, StepShape(size), batch, apply).total


def count_row(name: str, mode: str, batch: int, size: int, overrides: dict | None = None, top: int = 10) -> dict:
    """Kernel ops (per phase, and the ``top`` most frequent op names) and FLOPs of one step of ``name`` in
    ``mode`` at ``batch`` x ``size`` x ``size``, on the meta device."""
    model = build(name, overrides)
    configure(model, mode)
    t0 = time.perf_counter()
    c = count_step(model, batch, size)
    return {"ops": sum(c.ops.values()), "ops_by_phase": {p: c.ops[p] for p in PHASES}, "flops": c.flops,
            "top_ops": dict(c.by_name.most_common(top)), "count_seconds": round(time.perf_counter() - t0, 2)}


def host_syncs(name: str, mode: str, overrides: dict | None = None) -> dict:
    """Host reads of one real CPU training step of ``name`` in ``mode`` as the trainer runs it (``train_step``,
    SGD with momentum, multi-tensor as on CUDA; its second step, the optimizer's state made) at batch 2, 32x32, a
    size every registry model takes; and the kernel ops that step launches beyond the bare step's
    (``trainer_extra_ops``: the optimizer's update, the saved batch-norm statistics, the value checks), counted
    the same way on the same batch."""
    from edgerev.models.spec import model_spec
    from edgerev.train.cap import train_step

    model = build(name, overrides)
    configure(model, mode)
    spec, size = model_spec(model), 32
    bare = sum(count_step(model, 2, size, device="cpu").ops.values())
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, spec.in_channels, size, size)
    y = torch.randint(0, spec.num_classes, (2,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)  # CUDA's default
    with quantizer("cpu"):
        train_step(model, optimizer, x, y)  # the first step makes the optimizer's state (a copy per gradient)
    counter = KernelCounter()
    with counter, quantizer("cpu"):
        train_step(model, optimizer, x, y)
    return {"host_syncs": counter.syncs, "host_syncs_at": [2, size],
            "trainer_extra_ops": sum(counter.ops.values()) - bare}


def peak_row(name: str, mode: str, batch: int, size: int, overrides: dict | None = None) -> dict:
    """The predicted peak of one step of ``name`` in ``mode`` (``account_step``)."""
    model = build(name, overrides)
    t0 = time.perf_counter()
    peak = predicted_peak(model, batch, size, lambda m: configure(m, mode))
    return {"peak_bytes": peak, "peak_seconds": round(time.perf_counter() - t0, 2)}


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def plan_row(name: str, size: int, budget: int, max_batch: int, overrides: dict | None = None,
             top: int = 10, planned: Callable[[dict], None] = lambda d: None) -> dict:
    """Plan ``name`` at ``size`` under ``budget`` as a user does, apply the plan, and count the step it set up.

    Run in a fresh process: the planner keeps estimates and accounts for the process, and a first plan
    reads no profile cache (``EDGEREV_CACHE`` is an empty folder). ``planned`` is called with what is known
    as soon as the planner returns."""
    import dataclasses

    from edgerev.memory.plan.autoplan import plan_training

    model = build(name, overrides)
    before = os.environ.get("EDGEREV_CACHE")
    with tempfile.TemporaryDirectory(prefix="edgerev-kernels-") as cache:
        os.environ["EDGEREV_CACHE"] = cache
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            plan = plan_training(model, size, budget, "cuda", estimate=True, max_batch=max_batch, check=True,
                                 batches=[max_batch])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        finally:
            if before is None:
                os.environ.pop("EDGEREV_CACHE", None)
            else:
                os.environ["EDGEREV_CACHE"] = before
    fields = {f.name: _jsonable(getattr(plan, f.name)) for f in dataclasses.fields(plan)
              if f.name not in ("summary", "account", "profile")}
    modes = [m for m in (plan.modes or ()) if m is not None]
    known = {"plan": fields, "micro_batch": plan.batch, "exact": not any(m in ("store8", "store4") for m in modes),
             "plan_wall_seconds": round(wall, 2), "plan_cpu_seconds": round(cpu, 2)}
    planned(known)
    plan.apply(model)
    peak = predicted_peak(model, plan.batch, size, plan.apply)
    c = count_step(model, plan.batch, size)  # what plan.apply set up, nothing else
    ops = sum(c.ops.values())
    scale = max_batch / plan.batch
    return {**known, "peak_bytes": peak,
            "ops": ops, "ops_by_phase": {p: c.ops[p] for p in PHASES}, "flops": c.flops,
            f"ops_per_{max_batch}": round(ops * scale), f"flops_per_{max_batch}": round(c.flops * scale),
            "per_samples_note": None if plan.batch == max_batch else
            f"micro-batch {plan.batch} < {max_batch}: ops_per_{max_batch} = ops x {max_batch}/{plan.batch}",
            "top_ops": dict(c.by_name.most_common(top))}


# ---- running each measurement in a process of its own ------------------------------------------------------------

TASKS: dict[str, Callable[..., dict]] = {"count": count_row, "peak": peak_row, "syncs": host_syncs, "plan": plan_row}


class Task:
    """One measurement: ``TASKS[kind](**kwargs)`` in a child process. A ``plan`` task takes its budget from the
    result of its ``reference`` task (``factor`` times that peak), so it starts after it."""

    def __init__(self, key: tuple, kwargs: dict, cost: float, reference: tuple | None = None,
                 factor: float = 1.0) -> None:
        self.key, self.kwargs, self.cost, self.reference, self.factor = key, kwargs, cost, reference, factor
        self.limits: tuple[float | None, float | None] = (None, None)  # CPU seconds (see _child), set by the caller

    @property
    def kind(self) -> str:
        return self.key[0]


def _set_cpu_limit(seconds: float) -> None:
    """Stop this process (``SIGXCPU``) after ``seconds`` more CPU seconds, where the platform can."""
    if not _limit_cpu():
        return
    import resource

    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = math.ceil(time.process_time() + seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _child(kind: str, kwargs: dict, chunk: int | None, out: str, limits: tuple[float | None, float | None],
           eager: bool = False) -> None:
    """Run one task and write its result to ``out``. ``limits``: its CPU seconds, and for a plan task the CPU
    seconds of what follows the planning (its step's peak and count: the planner's own limit is the first);
    ``eager``: :data:`EAGER_QUANTIZER`."""
    import contextlib

    from edgerev import layers

    global EAGER_QUANTIZER
    EAGER_QUANTIZER = eager

    if limits[0] is not None:
        _set_cpu_limit(limits[0])

    def planned(partial: dict) -> None:  # what is known when the planner returns survives a later stop
        Path(out).write_text(json.dumps(partial))
        if limits[1] is not None:
            _set_cpu_limit(limits[1])

    torch.set_num_threads(1)  # nothing computes but the small host-sync step; one core per task
    budget = layers.chunk_budget(chunk) if chunk is not None else contextlib.nullcontext()
    c0 = time.process_time()
    try:
        with budget:
            result = TASKS[kind](**kwargs, **({"planned": planned} if kind == "plan" else {}))
    except Exception as e:  # noqa: BLE001 (a plan refused, a mode that fails: recorded, the rest goes on)
        result = {"error": f"{type(e).__name__}: {e}"[:500]}
    result["cpu_seconds"] = round(time.process_time() - c0, 2)
    Path(out).write_text(json.dumps(result))


def _limit_cpu() -> bool:
    """Whether this platform can stop a process at a number of CPU seconds (``RLIMIT_CPU``, ``SIGXCPU``)."""
    try:
        import resource
    except ImportError:
        return False
    return hasattr(resource, "RLIMIT_CPU") and hasattr(signal, "SIGXCPU")


def run_tasks(tasks: list[Task], jobs: int, chunk: int | None,
              log: Callable[[str], None] = lambda s: None, eager: bool = False) -> dict[tuple, dict]:
    """Run ``tasks`` in child processes, ``jobs`` at a time, the dearest first; ``jobs=0``: here, one by one
    (no limit). Returns each task's result by key. A task stops at its ``cpu_seconds`` (the kernel sends it
    ``SIGXCPU``); as a backstop, or where the platform has no CPU limit, it is killed after three times as
    many wall seconds and a minute (or as many, without a CPU limit)."""
    results: dict[tuple, dict] = {}
    pending = sorted(tasks, key=lambda t: -t.cost)

    def ready(t: Task) -> bool:
        return t.reference is None or t.reference in results

    def start_args(t: Task) -> dict | None:
        if t.reference is None:
            return t.kwargs
        ref = results[t.reference]
        if "peak_bytes" not in ref:
            results[t.key] = {"error": f"no reference peak: {ref.get('error', 'not measured')}"}
            return None
        budget = int(t.factor * ref["peak_bytes"])
        return {**t.kwargs, "budget": budget}

    if jobs <= 0:
        while pending:
            t = next(t for t in pending if ready(t))
            pending.remove(t)
            args = start_args(t)
            if args is not None:
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    _child(t.kind, args, chunk, f.name, (None, None), eager)
                    results[t.key] = json.loads(Path(f.name).read_text())
            log(f"{t.key}: done")
        return results
    methods = multiprocessing.get_all_start_methods()
    # fork: the parent has imported torch and run nothing, and a fresh import costs seconds per task
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    running: dict[tuple, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="edgerev-kernels-") as tmp:
        while pending or running:
            while len(running) < jobs and any(ready(t) for t in pending):
                t = next(t for t in pending if ready(t))
                pending.remove(t)
                args = start_args(t)
                if args is None:
                    continue
                out = str(Path(tmp) / f"{len(results) + len(running)}-{os.getpid()}-{time.monotonic_ns()}.json")
                proc = ctx.Process(target=_child, args=(t.kind, args, chunk, out, t.limits, eager))
                proc.start()
                running[t.key] = (proc, out, time.monotonic(), t.limits)
            if not running:  # nothing ready and nothing running: a reference never came
                for t in pending:
                    results[t.key] = {"error": "its reference was not measured"}
                break
            time.sleep(0.05)
            for key, (proc, out, started, limits) in list(running.items()):
                seconds = time.monotonic() - started
                cpu = sum(x for x in limits if x is not None)
                wall = math.inf if limits[0] is None else 3 * cpu + 60 if _limit_cpu() else cpu
                if proc.is_alive() and seconds < wall:
                    continue
                if proc.is_alive():
                    proc.kill()
                proc.join()
                del running[key]
                # what it wrote: its result, or (stopped) what a plan task knew when the planner returned
                results[key] = json.loads(Path(out).read_text()) if Path(out).exists() else {}
                if proc.exitcode == 0:
                    pass
                elif proc.exitcode == -getattr(signal, "SIGXCPU", 0):
                    phase = "after planning " if results[key] else ""
                    limit = limits[1] if results[key] else limits[0]
                    results[key]["error"] = f"{phase}not finished in {limit:.0f} CPU seconds (stopped)"
                elif seconds >= wall:
                    results[key]["error"] = f"not finished in {wall:.0f} s (killed)"
                else:
                    results[key]["error"] = f"its process ended with exit status {proc.exitcode}"
                results[key].setdefault("wall_seconds", round(seconds, 2))
                log(f"{key}: {results[key].get('error', 'done')} in {seconds:.1f} s")
    return results


# ---- what is measured, and the JSON --------------------------------------------------------------------------------

def tasks_for(a: argparse.Namespace) -> list[Task]:
    ov = a.overrides
    tasks: dict[tuple, Task] = {}

    def add(key: tuple, kwargs: dict, cost: float, **kw) -> None:
        tasks.setdefault(key, Task(key, kwargs, cost, **kw))

    for name in a.models:
        modes = ["plain", *(m for m in engine_modes(build(name, ov)) if a.modes is None or m in a.modes)]
        for mode in modes:
            add(("syncs", name, mode), {"name": name, "mode": mode, "overrides": ov}, 0.1)
            for size in a.sizes:
                scale = a.batch * size * size / (32 * 32 * 32)
                kw = {"name": name, "mode": mode, "batch": a.batch, "size": size, "overrides": ov}
                add(("count", name, mode, a.batch, size), {**kw, "top": a.top}, COST[mode] * scale)
                add(("peak", name, mode, a.batch, size), kw, 2 * COST[mode] * scale)
    for size in a.plan_sizes:
        scale = a.plan_batch * size * size / (32 * 32 * 32)
        kw = {"name": a.plan_model, "batch": a.plan_batch, "size": size, "overrides": ov}
        add(("count", a.plan_model, "plain", a.plan_batch, size), {**kw, "mode": "plain", "top": a.top}, scale)
        for mode, factor in a.caps:
            plan_kw = {"name": a.plan_model, "size": size, "max_batch": a.plan_batch, "overrides": ov, "top": a.top}
            if mode == "bytes":  # a cap in bytes: no reference to wait for
                add(("plan", size, mode, factor), {**plan_kw, "budget": int(factor)}, 10 * COST["floor"] * scale)
                continue
            ref = ("peak", a.plan_model, mode, a.plan_batch, size)
            add(ref, {**kw, "mode": mode}, 2 * COST[mode] * scale)
            add(("plan", size, mode, factor), {"name": a.plan_model, "size": size, "max_batch": a.plan_batch,
                                               "overrides": ov, "top": a.top},
                10 * COST[mode] * scale, reference=ref, factor=factor)
    return list(tasks.values())


def _ratio(x, y) -> float | None:
    return round(x / y, 3) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


def assemble(a: argparse.Namespace, results: dict[tuple, dict]) -> tuple[list[dict], list[dict]]:
    """The rows (model, mode, size) with their ratios to plain autograd, and the planned steps."""
    from edgerev.engine import Mode

    rows = []
    for key, count in results.items():
        if key[0] != "count" or key[1] not in a.models or key[3] != a.batch or key[4] not in a.sizes:
            continue
        _, name, mode, batch, size = key
        row = {"model": name, "mode": mode, "batch": batch, "size": size, **count,
               **results.get(("peak", name, mode, batch, size), {}), **results.get(("syncs", name, mode), {})}
        for part in ("count", "peak"):  # one row, two processes: say which failed
            err = results.get((part, name, mode, batch, size), {}).get("error")
            if err:
                row[f"{part}_error"] = err
        row.pop("error", None)
        row.pop("cpu_seconds", None)
        row.pop("wall_seconds", None)
        rows.append(row)
    by = {(r["model"], r["mode"], r["size"]): r for r in rows}
    order = ["plain", *(m.value for m in Mode)]
    for r in rows:
        base = by.get((r["model"], "plain", r["size"]), {})
        for f in ("ops", "flops", "peak_bytes"):
            r[f"{f}_vs_plain"] = _ratio(r.get(f), base.get(f))
    rows.sort(key=lambda r: (a.models.index(r["model"]), r["size"], order.index(r["mode"])))
    planned = []
    n = a.plan_batch
    for key, res in results.items():
        if key[0] != "plan":
            continue
        _, size, mode, factor = key
        ref = results.get(("peak", a.plan_model, mode, n, size), {}).get("peak_bytes") if mode != "bytes" else None
        plain_ = results.get(("count", a.plan_model, "plain", n, size), {})
        absolute = mode == "bytes"
        entry = {"model": a.plan_model, "size": size, "batch": n,
                 "cap": f"{factor / 1e6:.1f} MB" if absolute else f"{factor:.2f} x the all-{mode} peak",
                 "reference_mode": None if absolute else mode, "reference_peak_bytes": ref,
                 "cap_bytes": int(factor) if absolute else int(factor * ref) if ref else None, **res,
                 f"ops_per_{n}_vs_plain": _ratio(res.get(f"ops_per_{n}"), plain_.get("ops")),
                 f"flops_per_{n}_vs_plain": _ratio(res.get(f"flops_per_{n}"), plain_.get("flops")),
                 "peak_vs_reference": _ratio(res.get("peak_bytes"), ref),
                 "plain_ops": plain_.get("ops"), "plain_flops": plain_.get("flops")}
        planned.append(entry)
    planned.sort(key=lambda e: (e["size"], -(e["cap_bytes"] or 0)))
    return rows, planned


def _engine_state() -> dict:
    """The commit measured, and which engine files differ from it (the figures move as the engine changes)."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.rstrip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--", "edgerev/engine.py", "edgerev/layers", "edgerev/memory")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "engine_changes_not_committed": [line[3:] for line in (status or "").splitlines()]}


def _caps(text: str) -> list[tuple[str, float]]:
    """``MODE:FACTOR`` items (that mode's all-stage peak times the factor), or byte sizes (``610MB``: the cap
    itself, as ``("bytes", 610e6)``)."""
    from edgerev.errors import EdgerevError
    from edgerev.sizes import parse_bytes

    caps = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        mode, sep, factor = item.partition(":")
        if not sep:
            try:
                caps.append(("bytes", float(parse_bytes(item))))
                continue
            except EdgerevError:
                pass
        if mode not in COST or mode == "plain" or not factor:
            raise argparse.ArgumentTypeError(f"--caps: {item!r} is neither MODE:FACTOR (e.g. invert:1.10) "
                                             "nor a byte size (e.g. 610MB)")
        caps.append((mode, float(factor)))
    return caps


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from edgerev import layers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="the JSON file to write")
    p.add_argument("--models", default=None, help="comma-separated registry names (default: all)")
    p.add_argument("--modes", default=None, help="comma-separated engine modes (default: each model's; plain always)")
    p.add_argument("--batch", type=int, default=32, help="batch of the rows (default 32)")
    p.add_argument("--sizes", type=_ints, default=[32, 240], help="input sizes of the rows (default 32,240)")
    p.add_argument("--width", type=int, default=None, help="a width for every model (default: each model's)")
    p.add_argument("--plan-model", default="revnext", help="the model of the planned section (default revnext)")
    p.add_argument("--plan-batch", type=int, default=32, help="the planner's max_batch (default 32)")
    p.add_argument("--plan-sizes", type=_ints, default=[32, 240], help="sizes planned (default 32,240; '': none)")
    p.add_argument("--caps", type=_caps, default=[("invert", 1.10), ("floor", 1.10)],
                   help="caps as MODE:FACTOR of that mode's all-stage peak, or as bytes (610MB) "
                        "(default invert:1.10,floor:1.10)")
    p.add_argument("--top", type=int, default=10, help="the most frequent op names kept per row (default 10)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes at a time (default: the cores; 0: everything in this process, no timeout)")
    p.add_argument("--cpu-seconds", type=float, default=900,
                   help="CPU seconds one measurement may take (default 900)")
    p.add_argument("--plan-cpu-seconds", type=float, default=180,
                   help="CPU seconds the planner may take (default 180; the target is 30); its step's peak and "
                        "count then get --cpu-seconds")
    p.add_argument("--eager-quantizer", action="store_true",
                   help="count store8/store4's eager quantizer (what a CPU runs), not the fused one CUDA runs")
    if hasattr(layers, "chunk_budget"):  # the engine's default slice budget, where it still has one
        p.add_argument("--chunk-bytes", type=int, default=None,
                       help="slice budget of steps given none (default: the library's lean default)")
    a = p.parse_args(argv)
    from edgerev.models import list_models

    a.models = list_models() if a.models is None else [m for m in a.models.split(",") if m]
    a.modes = None if a.modes is None else [m for m in a.modes.split(",") if m and m != "plain"]
    a.overrides = {"width": a.width} if a.width else {}
    a.chunk_bytes = getattr(a, "chunk_bytes", None)
    return a


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    t0 = time.perf_counter()
    state = _engine_state()  # before anything runs: the source tree may change while this runs
    # every module a task needs, imported once before the first fork: one run measures one state of the code,
    # even while the source tree changes under it
    for module in ("torch.utils.flop_counter", "edgerev.memory.measure.account", "edgerev.memory.plan.autoplan",
                   "edgerev.memory.measure.profile", "edgerev.train.continual"):
        importlib.import_module(module)
    tasks = tasks_for(a)
    for t in tasks:
        t.limits = (a.plan_cpu_seconds, a.cpu_seconds) if t.kind == "plan" else (a.cpu_seconds, None)
    results = run_tasks(tasks, a.jobs, a.chunk_bytes,
                        log=lambda s: print(f"[{time.perf_counter() - t0:6.1f} s] {s}", file=sys.stderr, flush=True),
                        eager=a.eager_quantizer)
    rows, planned = assemble(a, results)
    from edgerev.layers import base

    default_slice = getattr(base, "chunk_bytes", lambda: None)()
    result = {
        "benchmark": "kernels", "command": "PYTHONPATH=. python benchmarks/kernels.py " + shlex.join(argv),
        "torch": torch.__version__, "python": platform.python_version(), "counted_on": "meta",
        "edgerev": state,
        "slice_bytes": a.chunk_bytes if a.chunk_bytes is not None else default_slice,
        "quantizer": "eager" if a.eager_quantizer or not hasattr(importlib.import_module("edgerev.quantize"), "fusing")
        else "fused (each operator counted at edgerev.quantize.LAUNCHES)",
        "what": "ops: ATen ops of one training step (forward, cross-entropy, backward), views and allocations "
                f"({', '.join(sorted(NOT_KERNELS))}) left out; host_syncs: _local_scalar_dense/item on a real CPU "
                "training step as the trainer runs it (host_syncs_at: batch, size); trainer_extra_ops: the kernel ops "
                "that step launches beyond the bare step at the same batch (optimizer, saved statistics, value checks; "
                "SGD multi-tensor, as on CUDA); flops: "
                "torch.utils.flop_counter's formulas; peak_bytes: edgerev.memory.measure.account.account_step on fake "
                "tensors; *_vs_plain: against plain autograd's row of the same model, batch and size",
        "rows": rows, "planned": planned, "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json(result, a.out)
    return result


if __name__ == "__main__":
    main()
