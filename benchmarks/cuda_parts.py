"""The measurements of the CUDA campaign (``benchmarks/cuda.py``), one function per part.

Each part runs in a process of its own and returns a JSON-ready dict; ``save`` writes what a part has
measured so far, so a part killed at its time limit still leaves its finished rows. Everything here calls
the library's own measurements (``edgerev.memory``), the trainer's own planning and cap
(``edgerev.train.memory.plan_memory``, ``edgerev.train.cap.train_step``), ``step_time.time_steps`` and
``train._run``: the campaign measures what they do on CUDA, it does not do it again.

On ``--device cpu`` (the dry run) the allocator's readings are the tracker's, and the cap is the tracker's
as the trainer enforces it on CPU; reserved bytes are None.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
RECIPE = CONFIGS / "gtx750.yaml"  # the GTX 750 recipe: revnext width 32, 32x32, steps of 512, 400 MiB cap
DATA_RECIPE = CONFIGS / "cpu-demo.yaml"  # its generated data set: no download on a machine without network

Save = Callable[[dict], None]


def _cuda(device: str) -> bool:
    return device == "cuda"


def environment(args, save: Save) -> dict:
    """Python, torch, CUDA, cuDNN, the GPU and its driver, and the allocator setting seen."""
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "cpu_count": os.cpu_count(), "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", total_memory_bytes=p.total_memory,
                   cudnn=torch.backends.cudnn.version(), arch_list=torch.cuda.get_arch_list(),
                   cudnn_benchmark=torch.backends.cudnn.benchmark)
        free, total = torch.cuda.mem_get_info()
        env["free_memory_bytes"] = free
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["driver"] = smi.stdout.strip() if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = None
    return env


def model_modes(arch: str, overrides: dict) -> list[str]:
    """The engine modes at least one stage of ``arch`` supports, in the engine's order."""
    from edgerev.engine import Mode, supported_modes
    from edgerev.models import create_model

    body = create_model(arch, **overrides).body
    have = {m for s in body.stages for m in supported_modes(s)}
    return [m.value for m in Mode if m in have]


def configurations(args) -> list[tuple[str, str]]:
    return [(arch, mode) for arch in args.models for mode in model_modes(arch, args.overrides)]


def memory(args, save: Save) -> dict:
    """Peak allocated and reserved bytes (allocator) and the tracker's peak on the same device, per model and mode.

    Each configuration runs a warm-up step first (one-time allocations such as cuBLAS's workspace land in
    the baseline, as in a training run's later steps), then one step read by the allocator, then one counted
    by the tracker on the same device's tensors. The cache is emptied between configurations so a reserved
    peak belongs to its own configuration. Plain autograd's step of each model is read and timed the same way
    first (``plain``): each row's ``relative_to_plain`` is its step time over plain's at this batch and size.
    """
    import torch

    from edgerev import plain
    from edgerev.memory.measure.peak import set_modes, step_peak
    from edgerev.models import create_model

    rows: list[dict] = []
    plains: dict[str, dict] = {}
    result = {"batch": args.batch, "size": args.size, "overrides": args.overrides, "rows": rows, "plain": plains,
              "tracker_on": args.device,
              "allocator": "torch.cuda max_memory_allocated / max_memory_reserved" if _cuda(args.device)
              else "none (CPU): the tracker's figure stands in for the allocator's"}

    def one_step(model) -> dict:
        """A warm-up step (one-time allocations such as cuBLAS's workspace land in the baseline), then one step
        read by the allocator and timed: each mode's and plain autograd's the same way."""
        step_peak(model, min(2, args.batch), args.size, args.device)
        if _cuda(args.device):
            torch.cuda.empty_cache()
        t1 = time.perf_counter()
        alloc = step_peak(model, args.batch, args.size, args.device)
        row = {"step_seconds": round(time.perf_counter() - t1, 3), "allocated_peak_bytes": alloc.peak_bytes,
               "reserved_peak_bytes": alloc.reserved_bytes, "allocated_baseline_bytes": alloc.baseline_bytes}
        if not _cuda(args.device):  # the tracker read the step
            row.update(tracker_peak_bytes=alloc.peak_bytes, tracker_baseline_bytes=alloc.baseline_bytes,
                       tracker_peak_op=alloc.peak_op, allocated_minus_tracker_bytes=0)
        return row

    # plain autograd's step first (the cheapest): the step_time part divides each mode's step by it
    for arch in args.models:
        try:
            torch.manual_seed(0)
            model = create_model(arch, **args.overrides).to(args.device)
            with plain(model):
                plains[arch] = one_step(model)
        except Exception as e:  # noqa: BLE001
            plains[arch] = {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            model = None
            if _cuda(args.device):
                torch.cuda.empty_cache()
        save(result)
    # the engine slices per-sample temporaries to the chunk budget: at 240x240 a RevNeXt step in invert mode
    # runs some 380,000 ops and in floor mode 2.3 million (counted on fake tensors), seconds of kernel
    # launches on any GPU; the cheap modes go first so that a time limit cuts the dearest rows
    order = {m: i for i, m in enumerate(("store", "recompute", "invert", "store8", "store4", "floor"))}
    for arch, mode in sorted(configurations(args), key=lambda c: order.get(c[1], 0)):
        row: dict = {"arch": arch, "mode": mode}
        t0 = time.perf_counter()
        try:
            torch.manual_seed(0)
            model = create_model(arch, **args.overrides).to(args.device)
            set_modes(model, mode)
            row.update(one_step(model))
            base = plains.get(arch, {}).get("step_seconds")
            row["relative_to_plain"] = round(row["step_seconds"] / base, 3) if base else None
            # on CPU the step was the tracker's already (one_step)
            if _cuda(args.device) and row["step_seconds"] <= args.tracker_seconds:
                tracked = step_peak(model, args.batch, args.size, args.device, tracker=True)
                row.update(tracker_peak_bytes=tracked.peak_bytes, tracker_baseline_bytes=tracked.baseline_bytes,
                           tracker_peak_op=tracked.peak_op,
                           allocated_minus_tracker_bytes=row["allocated_peak_bytes"] - tracked.peak_bytes)
            elif _cuda(args.device):
                # the tracker's dispatch costs several times the step: the prediction counts the same tensors
                row["tracker_skipped"] = f"the step took {row['step_seconds']} s (over --tracker-seconds)"
        except Exception as e:  # noqa: BLE001 (an OOM or a CUDA error of one configuration: recorded, next one)
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            model = None
            if _cuda(args.device):
                torch.cuda.empty_cache()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        save(result)
    return result


def _predict_one(arch: str, mode: str, batch: int, size: int, overrides: dict, device: str) -> dict:
    """The fake-tensor prediction of one configuration's step (a worker process: one thread), with what the math
    libraries take on ``device`` where it is a CUDA device (measured there, as a CUDA plan counts it)."""
    import torch

    torch.set_num_threads(1)
    from edgerev.memory.measure.peak import fake_step_peak, set_modes
    from edgerev.memory.measure.workspaces import counting, for_device
    from edgerev.models import create_model

    t0 = time.perf_counter()
    model = create_model(arch, **overrides)
    set_modes(model, mode)
    lib = for_device(device)
    with counting(lib):
        peak = fake_step_peak(model, None, batch, size)
    return {"arch": arch, "mode": mode, "predicted_peak_bytes": peak, "seconds": round(time.perf_counter() - t0, 2),
            **({"libraries": lib.summary()} if lib is not None else {})}


def predict(args, save: Save) -> dict:
    """``fake_step_peak`` of every configuration of the memory part, in parallel processes: fake tensors on the CPU,
    and on CUDA each convolution's own workspace and cuBLAS's, measured on the device as a CUDA plan counts them.

    A fake-tensor step of RevNeXt at 32 x 240 x 240 runs every batch slice of every layer through
    FakeTensorMode: tens of seconds of CPU each, so the configurations run on ``--workers`` processes
    beside the GPU parts, the largest first.
    """
    import concurrent.futures
    import multiprocessing

    rows: list[dict] = []
    result = {"batch": args.batch, "size": args.size, "workers": args.workers, "rows": rows}
    configs = configurations(args)
    # RevNeXt's engine modes slice per sample and take longest: start them first
    configs.sort(key=lambda c: (c[0] != "revnext", c[1] not in ("floor", "store4", "store8")))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        futures = {pool.submit(_predict_one, a, m, args.batch, args.size, args.overrides, args.device): (a, m)
                   for a, m in configs}
        for f in concurrent.futures.as_completed(futures):
            arch, mode = futures[f]
            try:
                rows.append(f.result())
            except Exception as e:  # noqa: BLE001
                rows.append({"arch": arch, "mode": mode, "error": f"{type(e).__name__}: {e}"[:500]})
            save(result)
    return result


def recipe(args):
    """The GTX 750 recipe as the cap and training parts run it: its model, optimizer and cap (``--cap``),
    on the generated data set of the CPU demo, at ``--recipe-size`` with ``--recipe-args`` merged into
    the model's arguments."""
    from edgerev.train.config import load_config

    cfg = load_config(RECIPE)
    demo = load_config(DATA_RECIPE)
    size = args.recipe_size or cfg.data.size
    train_src = dataclasses.replace(demo.data.train, samples=args.train_samples)
    data = dataclasses.replace(demo.data, train=train_src, size=size)
    model = dataclasses.replace(cfg.model, args={**cfg.model.args, **args.recipe_args})
    train = dataclasses.replace(cfg.train, epochs=args.epochs, batch=args.recipe_batch,
                                checkpoint_every=10**9)
    memory = dataclasses.replace(cfg.memory, budget=args.cap, profile=args.profile)
    return dataclasses.replace(cfg, model=model, data=data, augment=demo.augment, train=train, memory=memory,
                               device=args.device)


def _recipe_model(cfg):
    from edgerev.models import create_model

    return create_model(cfg.model.arch, **cfg.model.args)


def profile(args, save: Save) -> dict:
    """The planner's per-stage profile of the recipe's model on this device, into the campaign's cache
    (``EDGEREV_CACHE``), so that the cap and training parts plan from it as a daemon's second job would."""
    import torch

    from edgerev.memory.measure import profile as profiles

    cfg = recipe(args)
    torch.manual_seed(0)
    model = _recipe_model(cfg).to(args.device)
    t0 = time.perf_counter()
    p = profiles.load_or_measure(model, cfg.data.size, args.device, estimate=cfg.memory.profile == "estimate")
    return {"arch": cfg.model.arch, "args": cfg.model.args, "size": cfg.data.size, "source": p.source,
            "stages": len(p.stages), "seconds": round(time.perf_counter() - t0, 2)}


def _peaks(device: str) -> dict:
    import torch

    if not _cuda(device):
        return {}
    return {"allocated_peak_bytes": torch.cuda.max_memory_allocated(), "reserved_peak_bytes":
            torch.cuda.max_memory_reserved()}


def _allocator(device: str) -> dict:
    """The caching allocator's own account of the part: its out-of-memory errors and retries, its reserved
    peak per pool, and the two totals a cap's fraction may be taken of (the device properties' and
    ``cudaMemGetInfo``'s: torch versions differ in which the allocator multiplies)."""
    import torch

    if not _cuda(device):
        return {}
    s = torch.cuda.memory_stats()
    keys = ("num_ooms", "num_alloc_retries", "reserved_bytes.all.peak", "reserved_bytes.large_pool.peak",
            "reserved_bytes.small_pool.peak", "segment.all.peak")
    return {"allocator": {k: s.get(k) for k in keys}, "properties_total_bytes":
            torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
            "mem_get_info_total_bytes": torch.cuda.mem_get_info()[1]}


def cap(args, save: Save) -> dict:
    """The recipe under its cap, planned and enforced as the trainer does (``plan_memory``: on CUDA it sets
    ``set_per_process_memory_fraction``; on CPU it returns the tracker's cap).

    1. ``--steps`` optimizer steps of the recipe's batch in the planned micro-batches: out-of-memory
       retries are counted (the plan promises none);
    2. forced steps of one micro-batch, twice the planned one and doubling until a step runs out of
       memory: that step must recover by halving its micro-batch, and step once;
    3. the allocator's peak allocated and reserved bytes against the cap, over the whole part.
    """
    import torch

    from edgerev.train.cap import CpuCap, train_step
    from edgerev.train.memory import plan_memory

    cfg = recipe(args)
    device = torch.device(args.device)
    budget = int(cfg.memory.budget)
    batch = cfg.train.batch
    torch.manual_seed(0)
    model = _recipe_model(cfg).to(device)
    t0 = time.perf_counter()
    planned = plan_memory(cfg, model, None, batch, device)
    micro_batches, cpu_cap, summary = planned.micro_batches, planned.cap, planned.summary
    result: dict = {"arch": cfg.model.arch, "args": cfg.model.args, "size": cfg.data.size, "batch": batch,
                    "cap_bytes": budget, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                    "plan_seconds": round(time.perf_counter() - t0, 2), "micro_batch": summary["micro_batch"],
                    "micro_batches": micro_batches, "predicted_peak_bytes": summary["predicted_peak_bytes"],
                    "stages": [s["mode"] for s in summary["stages"]], "device_fit": summary.get("device_fit")}
    save(result)
    o = cfg.optim
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=o.momentum, nesterov=o.nesterov,
                                weight_decay=o.weight_decay)
    if _cuda(args.device):
        torch.cuda.reset_peak_memory_stats()
    x = torch.randn(batch, model.in_channels, cfg.data.size, cfg.data.size, device=device)
    y = torch.randint(0, model.num_classes, (batch,), device=device)
    retries, splits, losses = 0, [], []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        if time.perf_counter() - t0 > 0.5 * args.part_seconds:  # leave time for the forced steps
            break
        r = train_step(model, optimizer, x, y, micro_batches=micro_batches, cap=cpu_cap,
                       clip_grad_norm=o.clip_grad_norm)
        retries += r.retries
        micro_batches = r.micro_batches  # as the trainer carries it
        splits.append(r.micro_batches)
        losses.append(r.loss)
    result["planned"] = {"steps": len(splits), "steps_asked": args.steps, "oom_retries": retries,
                         "micro_batches": sorted(set(splits)),
                         "seconds_per_step": (time.perf_counter() - t0) / max(1, len(splits)),
                         "loss_first_last": [losses[0], losses[-1]] if losses else None,
                         "tracker_peak_bytes": cpu_cap.peak if cpu_cap is not None else None,
                         **_peaks(args.device)}
    del x, y
    save(result)

    # a step of one micro-batch larger than the plan's, doubling until it runs out of memory; on CPU the
    # tracker guards it with the live bytes before it as baseline (``CpuCap.over_alive``)
    forced, attempts = 2 * summary["micro_batch"], []
    result["forced"] = attempts
    while len(attempts) < args.forced_tries:
        attempt: dict = {"batch": forced}
        attempts.append(attempt)
        try:
            fx = torch.randn(forced, model.in_channels, cfg.data.size, cfg.data.size, device=device)
            fy = torch.randint(0, model.num_classes, (forced,), device=device)
            before = [p.detach().clone() for p in model.parameters()]
            guard = None if _cuda(args.device) else CpuCap.over_alive(budget, model, optimizer, fx, fy)
            r = train_step(model, optimizer, fx, fy, micro_batches=1, clip_grad_norm=o.clip_grad_norm, cap=guard)
            stepped = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
            attempt.update(retries=r.retries, micro_batches=r.micro_batches, loss=r.loss, stepped=stepped,
                           finite=math.isfinite(r.loss))
        except Exception as e:  # noqa: BLE001 (StepFailed, or the batch itself beyond the cap)
            attempt["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            fx = fy = before = None
        attempt.update(_peaks(args.device))  # the part's peaks so far: which attempt reached them
        save(result)
        if attempt.get("retries", 0) > 0 or "error" in attempt:
            break
        forced *= 2
    result["recovered"] = any(a.get("retries", 0) > 0 and a.get("stepped") and a.get("finite") for a in attempts)
    result.update(_peaks(args.device), **_allocator(args.device))
    if _cuda(args.device):
        result["reserved_under_cap"] = result["reserved_peak_bytes"] <= budget
    return result


def _kernel_ops(arch: str, overrides: dict, variants: list[str], batch: int, size: int, until: float) -> dict:
    """Kernel ops of one step per variant, counted on the meta device by the CPU (``kernels.count_step``),
    while the part has time (``until``, a ``time.monotonic`` reading)."""
    from kernels import build, configure, count_step

    ops = {}
    for v in variants:
        if time.monotonic() > until:
            break
        model = build(arch, overrides)
        configure(model, v)
        ops[v] = sum(count_step(model, batch, size).ops.values())
    return ops


def step_time(args, save: Save) -> dict:
    """Step time of each mode against plain autograd, same weights, interleaved (``step_time.time_steps``),
    with each variant's kernel ops per step (meta device); and at the memory part's batch and size, each mode's
    one step there over plain autograd's (``--size-steps``: its steps, timed alike after a warm-up)."""
    import statistics

    from step_time import time_steps

    rows: list[dict] = []
    result = {"batch": args.time_batch, "size": args.time_size, "repeats": args.repeats, "rows": rows,
              "at_size": {"batch": args.batch, "size": args.size,
                          "from": "the memory part: one step per mode and plain autograd's, each after a warm-up"}}
    started = time.monotonic()
    for arch in sorted(args.models, key=lambda a: a != "revnext"):
        if time.monotonic() - started > 0.6 * args.part_seconds:
            rows.append({"arch": arch, "error": "not timed: the part's time was running out"})
            continue
        modes = model_modes(arch, args.overrides)
        try:
            times = time_steps(arch, args.time_batch, args.time_size, args.device, args.repeats, 1, modes)
            base = statistics.median(times["plain"])
            row = {"arch": arch, "median_seconds": {v: statistics.median(t) for v, t in times.items()},
                   "relative_to_plain": {v: statistics.median(t) / base for v, t in times.items()}}
            sized = (args.size_steps or {}).get(arch, {})
            if sized.get("plain"):
                row["at_size"] = {"step_seconds": sized,
                                  "relative_to_plain": {v: s / sized["plain"] for v, s in sized.items()}}
            rows.append(row)
        except Exception as e:  # noqa: BLE001
            rows.append({"arch": arch, "error": f"{type(e).__name__}: {e}"[:500]})
        save(result)
    # the counts after every timing, so that they never crowd a model's timing out of the part's limit
    for row in rows:
        if "median_seconds" not in row:
            continue
        try:
            row["kernel_ops"] = _kernel_ops(row["arch"], args.overrides, list(row["median_seconds"]),
                                            args.time_batch, args.time_size, started + 0.85 * args.part_seconds)
        except Exception as e:  # noqa: BLE001
            row["kernel_ops_error"] = f"{type(e).__name__}: {e}"[:500]
        save(result)
    return result


def train(args, save: Save) -> dict:
    """A short real run of the recipe under its cap on the generated data set (``train._run``)."""
    import tempfile

    from train import _run

    from edgerev.train.trainer import SUMMARY

    cfg = recipe(args)
    asked = cfg.train.epochs
    if args.train_step_seconds:  # the cap part timed this recipe's step: as many epochs as half the limit allows
        steps = math.ceil(cfg.data.train.samples * (1 - cfg.data.val_fraction * (cfg.data.val is None))
                          / cfg.train.batch)
        fits = int(0.5 * args.part_seconds / (steps * args.train_step_seconds))
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=max(1, min(asked, fits))))
    with tempfile.TemporaryDirectory() as tmp:
        r = _run(cfg, Path(tmp) / "run")
        plan = json.loads((Path(tmp) / "run" / SUMMARY).read_text())["plan"]
    for key in ("forgetting", "start_old_acc"):  # no continual learning here
        r.pop(key, None)
    r["final"] = {k: v for k, v in r["final"].items() if v is not None}
    return {"arch": cfg.model.arch, "args": cfg.model.args, "size": cfg.data.size, "epochs": cfg.train.epochs,
            "epochs_asked": asked,
            "batch": cfg.train.batch, "train_samples": cfg.data.train.samples,
            "val_samples": cfg.data.val.samples if cfg.data.val else None, "cap_bytes": int(cfg.memory.budget),
            "plan": {k: plan.get(k) for k in ("micro_batch", "micro_batches", "predicted_peak_bytes",
                                              "measured_peak_bytes", "cuda_graphs")}, **r}


PARTS: dict[str, Callable] = {"environment": environment, "memory": memory, "predict": predict,
                              "profile": profile, "step_time": step_time, "cap": cap, "train": train}


def run_part(name: str, args, out: Path) -> None:
    """Run part ``name`` and write its result to ``out`` (also as it goes, through ``save``)."""

    def save(partial: dict) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"partial": True, **partial}))
        tmp.replace(out)

    from edgerev.layers import chunk_budget

    t0 = time.perf_counter()
    with chunk_budget(args.chunk_bytes):
        result = PARTS[name](args, save)
    result["part_seconds"] = round(time.perf_counter() - t0, 2)  # a background part is waited for later
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    sys.stdout.flush()
