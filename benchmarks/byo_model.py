"""Bring your own model (issue 21): three standard CNNs exported by torch, imported by edgerev, trained under a cap.

For MobileNetV2, ResNet-18 and EfficientNet-B0 (:mod:`edgerev.models.designs`, their published designs), at
``--size`` (224) and ``--batch`` (8):

- ``fidelity``: each design (random weights, batch-norm statistics moved off their defaults) is exported with
  ``torch.onnx.export`` (dynamo, dynamic batch) and imported with :func:`edgerev.models.onnx_import.load_onnx`;
  the largest difference of its logits against ONNX Runtime on the original file, on one batch.
- ``memory``: peak bytes of one training step (forward, cross-entropy, backward; weights, batch and labels
  included, no optimizer state) on fake tensors with the step's one accounting
  (:func:`edgerev.memory.measure.account.account_step`): plain autograd; edgerev's least-memory plan with every
  parameter trained; the same with ``bias`` (biases and the head) trained. The planner's parts come from
  :mod:`edgerev.memory.graph` and :mod:`edgerev.train.trainable`; where they are missing the JSON says so.
- ``torch``: torch's own answer, ``torch._functorch.config.activation_memory_budget`` under ``torch.compile``,
  over a sweep of budgets. How it is measured on the CPU: the backend is AOT autograd with the min-cut
  partitioner and inductor's decompositions (what inductor partitions) whose forward and backward graphs run op
  by op under edgerev's :class:`~edgerev.memory.measure.tracker.MemoryTracker` (the tracker counts every tensor the
  graphs allocate; inductor's own kernels allocate through a path no dispatch mode sees). So the figure is the
  partitioner's choice of what to keep, run without inductor's fusions: an upper bound of inductor's peak.
  With ``--device cuda`` the step runs inductor itself and the allocator's peak is read. Step time is given as
  a ratio to plain autograd measured the same way in the same run. ``same_time`` picks the budget whose step
  time is nearest edgerev's least-memory plan's ratio.
- ``time``: step time of edgerev's plan at a budget of half the plain peak, as a ratio to plain autograd, both
  timed in turn in one run (median of ``--repeats``).
- ``fewshot``: scikit-learn's digits (real 8x8 scans, upscaled to 32x32, three channels). Each design
  (``--fewshot-width``) is pretrained on digits 0-4 (70 % of them), exported to ONNX twice (batch norm kept:
  the TorchScript exporter without constant folding; and folded into the convolutions: the dynamo exporter's
  default) and imported; its head grows to ten classes, the new rows are fitted to the imported features (the
  trainer's ``continual.probe``; ``--no-probe``: left at their random initialization), and it is fine-tuned on
  20 images of each of the digits 5-9 (with distillation from the imported model and a replay of 20 images of
  each old digit) as the trainer's recipe fine-tunes each (:data:`edgerev.train.config.DEFAULT_LR`,
  ``DEFAULT_CLIP`` and ``DEFAULT_ADAPTIVE_CLIP``, relative to ``--finetune-lr``: the folded one's gradient clipped
  unit by unit, :func:`edgerev.train.optim.adaptive_clip_`; without batch norm the same rate unclipped diverges);
  accuracy on held-out new and old digits, against the same recipe from random weights (no teacher: there is
  none), each the mean over ``--fewshot-seeds`` fine-tuning seeds (batch order, grown rows, random weights; the
  pretrained model and the split are ``--seed``'s), every run beside.

Each part writes its figures into the JSON as it ends (``--out``), and a part whose library pieces are missing
records what is missing instead of failing the run.

    OMP_NUM_THREADS=1 python benchmarks/byo_model.py --out results/byo_model.json
    OMP_NUM_THREADS=1 python benchmarks/byo_model.py --parts fewshot --out results/byo_fewshot.json
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _common import quiet, write_json
from torch import nn

from edgerev._torchapi import storage_bytes
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.tracker import CudaPeak, MemoryTracker
from edgerev.models.designs import DESIGNS
from edgerev.train.config import ContinualConfig
from edgerev.train.continual import ContinualLoss, fit_new_rows, grow_head, head_inputs
from edgerev.train.optim import adaptive_clip_

PARTS = ("fidelity", "memory", "torch", "time", "fewshot")
BUDGETS = (1.0, 0.5, 0.2, 0.0)
MiB = 2**20


class Missing(Exception):
    """A library piece this part needs is not there yet: recorded, not raised."""


def build(name: str, num_classes: int, width: float, seed: int = 0) -> nn.Module:
    """A design with random weights and batch-norm statistics moved off their defaults (so an import that
    dropped or misread them would show), and logits of a visible size."""
    torch.manual_seed(seed)
    model = DESIGNS[name](num_classes=num_classes, width=width)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 1 / m.in_features ** 0.5)
    return model.eval()


def export(model: nn.Module, size: int, path: Path, keep_bn: bool = False) -> float:
    """``torch.onnx.export`` as a user would call it; returns seconds. By default the dynamo exporter with a
    dynamic batch, whose ``optimize=True`` folds batch norm into the convolutions. ``keep_bn``: the TorchScript
    exporter without constant folding, which keeps batch norm (the dynamo exporter's ``optimize=False`` keeps it
    too, but writes CastLike nodes the import does not take yet)."""
    start = time.perf_counter()
    with quiet(), torch.no_grad():
        example = (torch.zeros(2, 3, size, size),)
        if keep_bn:
            torch.onnx.export(model, example, str(path), dynamo=False, do_constant_folding=False,
                              input_names=["input"], output_names=["logits"],
                              dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
        else:
            program = torch.onnx.export(model, example, dynamo=True, input_names=["input"], output_names=["logits"],
                                        dynamic_shapes=({0: torch.export.Dim("batch")},))
            program.save(str(path))
    return time.perf_counter() - start


def load_imported(path: Path) -> nn.Module:
    try:
        from edgerev.models.onnx_import import load_onnx
    except ImportError as e:
        raise Missing(f"edgerev.models.onnx_import.load_onnx: {e}") from None
    return load_onnx(path)


# ---- fidelity ----------------------------------------------------------------------------------------------


def fidelity(name: str, a, tmp: Path) -> dict:
    from edgerev.export.runtime import inference_session

    model = build(name, 1000, a.width)
    path = tmp / f"{name}.onnx"
    seconds = export(model, a.size, path)
    x = torch.randn(a.batch, 3, a.size, a.size, generator=torch.Generator().manual_seed(1))
    ort = inference_session(str(path)).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        eager = model(x).numpy()
    out = {"export_seconds": round(seconds, 2), "onnx_bytes": path.stat().st_size,
           "max_abs_logit": float(np.abs(ort).max()), "ort_vs_pytorch": float(np.abs(ort - eager).max())}
    start = time.perf_counter()
    imported = load_imported(path).eval()
    out["import_seconds"] = round(time.perf_counter() - start, 2)
    with torch.no_grad():
        got = imported(x).numpy()
    out["import_vs_ort"] = float(np.abs(got - ort).max())
    out["parameters"] = sum(p.numel() for p in imported.parameters())
    return out


# ---- memory: plain, edgerev's plans ------------------------------------------------------------------------


def plain_peak(model: nn.Module, a) -> int:
    return account_step(model, StepShape(a.size), a.batch, lambda m: None).total


def _graph_parts():
    try:
        from edgerev.memory import graph
        from edgerev.memory.plan import autoplan
        from edgerev.train import trainable
    except ImportError as e:
        raise Missing(f"edgerev.memory.graph / edgerev.train.trainable: {e}") from None
    return autoplan, graph, trainable


#: the planner's smallest segmentations (autoplan's floor candidates), in its order
FLOOR_KINDS = ("store4 per piece", "store4 in one segment", "checkpoint per piece")


def edgerev_plans(model: nn.Module, a) -> dict:
    """edgerev's least-memory plans at the whole batch, every parameter trained and ``bias`` (+ head) trained:
    each of the planner's smallest segmentations accounted exactly at micro-batch ``--batch``, and the floor
    (micro-batch 1, gradients accumulated to the batch) as the planner would take it under the least budget."""
    from dataclasses import replace

    autoplan, _, trainable = _graph_parts()
    out = {}
    for which in ("all", "bias"):
        net = copy.deepcopy(model)
        run = trainable.set_trainable(net, which, size=a.size)
        step = StepShape(a.size)
        floors = autoplan._SegmentsSolver(run, a.size, "cpu").floors()
        kinds = {kind: autoplan.accounted(run, step, replace(f, batch=a.batch)).total
                 for kind, f in zip(FLOOR_KINDS, floors)}
        exact = {k: v for k, v in kinds.items() if not k.startswith("store4")}
        _, floor = autoplan.floor_plan(run, StepShape(a.size, batch=a.batch))
        out[which] = {"pieces": len(run.chain), "trainable_parameters": trainable.trainable_count(run),
                      "least_bytes": min(kinds.values()), "least_exact_bytes": min(exact.values()),
                      "candidates_bytes": kinds, "floor_bytes_micro_batch_1": floor.total}
    return out


def memory(name: str, a) -> dict:
    model = build(name, 1000, a.width).train()
    start = time.perf_counter()
    out = {"plain_bytes": plain_peak(model, a), "plain_seconds": round(time.perf_counter() - start, 2),
           "weights_bytes": storage_bytes([*model.parameters(), *model.buffers()])}
    try:
        out.update(edgerev_plans(model, a))
    except Missing as e:
        out["edgerev"] = {"missing": str(e)}
    return out


# ---- torch's answer: activation_memory_budget under torch.compile -------------------------------------------


class _Window:
    """The tracker the compiled graphs run under while a measured step runs (None: not measuring)."""

    tracker: MemoryTracker | None = None


def tracked_backend():
    """AOT autograd with the min-cut partitioner and inductor's decompositions, whose graphs run op by op
    under :attr:`_Window.tracker` (private torch APIs: a benchmark, not the library)."""
    import torch._inductor.lowering  # noqa: F401  (inductor's decompositions look it up)
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def compiler(gm, example_inputs):
        def run(*args):
            if _Window.tracker is None:
                return gm(*args)
            with _Window.tracker:
                return gm(*args)

        return make_boxed_func(run)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition,
                        decompositions=select_decomp_table())


def _step_fn(model: nn.Module):
    def step(x, y):
        return F.cross_entropy(model(x), y)

    return step


def _measure(step, model: nn.Module, x, y, device: str, repeats: int, compiled: bool) -> tuple[int, float]:
    """Peak bytes (weights, batch and labels included) and median seconds of ``step``'s training step."""
    baseline = storage_bytes([*model.parameters(), *model.buffers(), x, y])
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        with CudaPeak(device) as cp:
            step(x, y).backward()
        peak = cp.peak
    else:
        tracker = MemoryTracker(baseline=baseline)
        if compiled:
            _Window.tracker = tracker
            try:
                step(x, y).backward()
            finally:
                _Window.tracker = None
        else:
            with tracker:
                step(x, y).backward()
        peak = tracker.peak
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(x, y).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times)


def torch_budget(name: str, a) -> dict:
    import torch._functorch.config as functorch_config

    device = a.device
    model = build(name, 1000, a.width).train().to(device)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(a.batch, 3, a.size, a.size, generator=gen).to(device)
    y = torch.randint(0, 1000, (a.batch,), generator=gen).to(device)
    step = _step_fn(model)
    step(x, y).backward()  # warm-up
    plain_bytes, plain_s = _measure(step, model, x, y, device, a.repeats, compiled=False)
    out = {"how": ("inductor, CUDA allocator's peak" if device == "cuda" else
                   "min-cut partitioner + inductor decompositions run op by op under the CPU tracker"),
           "plain_bytes": plain_bytes, "plain_seconds": plain_s, "budgets": {}}
    for budget in a.budgets:
        torch._dynamo.reset()
        start = time.perf_counter()
        with functorch_config.patch(activation_memory_budget=budget), quiet():
            compiled = torch.compile(step, backend="inductor" if device == "cuda" else tracked_backend())
            model.zero_grad(set_to_none=True)
            compiled(x, y).backward()  # compiles
            compile_s = time.perf_counter() - start
            peak, seconds = _measure(compiled, model, x, y, device, a.repeats, compiled=True)
        out["budgets"][str(budget)] = {"peak_bytes": peak, "seconds": seconds, "time_ratio": seconds / plain_s,
                                       "peak_ratio": peak / plain_bytes, "compile_seconds": round(compile_s, 1)}
        print(f"  torch {name} budget {budget}: {peak / MiB:.1f} MiB ({peak / plain_bytes:.2f} of plain), "
              f"{seconds / plain_s:.2f}x time", file=sys.stderr, flush=True)
    torch._dynamo.reset()
    return out


# ---- step time at half the plain peak ----------------------------------------------------------------------


def half_budget_time(name: str, a) -> dict:
    """edgerev's plan under half the plain peak against plain autograd, timed in turn in one run."""
    import math

    import edgerev
    from edgerev.memory.measure.microbatch import accumulate, split_batch

    autoplan, graph, _ = _graph_parts()
    model = build(name, 1000, a.width).train()
    plain_bytes = plain_peak(model, a)
    budget = plain_bytes // 2
    start = time.perf_counter()
    p = edgerev.plan(model, size=a.size, budget=budget, batch=a.batch, momentum=False)
    plan_s = time.perf_counter() - start
    p.apply(model)
    run = graph.planned(model, a.size)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(a.batch, 3, a.size, a.size, generator=gen), torch.randint(0, 1000, (a.batch,), generator=gen)
    parts = split_batch(a.batch, math.ceil(a.batch / p.batch))
    variants = {"plain": lambda: F.cross_entropy(model(x), y).backward(),
                "edgerev": lambda: accumulate(run, x, (y,), parts, F.cross_entropy)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a.repeats + 1):
        for k, fn in variants.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    segments = p.summary.get("segments") or p.summary.get("stages")
    return {"budget_bytes": budget, "plain_bytes": plain_bytes, "micro_batch": p.batch,
            "predicted_peak_bytes": p.predicted_peak_bytes, "plan_seconds": round(plan_s, 1),
            "plan": segments, "median_seconds": med, "time_ratio": med["edgerev"] / med["plain"]}


# ---- few-shot on scikit-learn's digits ----------------------------------------------------------------------


def digits(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1797 digits as ``float [N, 3, size, size]`` in 0..1 and labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1).repeat(1, 3, 1, 1)
    return (x - 0.5) / 0.25, torch.from_numpy(d.target.astype(np.int64))


def split_digits(size: int, shots: int, seed: int):
    """Old digits 0-4: 70 % to pretrain, 30 % held out; new digits 5-9: ``shots`` each to fine-tune, the rest held
    out; ``shots`` of each old digit from the pretraining set as the replay sample."""
    x, y = digits(size)
    g = torch.Generator().manual_seed(seed)
    pre, old_test, new_train, new_test, replay = [], [], [], [], []
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        if c < 5:
            cut = int(0.7 * len(idx))
            pre.append(idx[:cut])
            old_test.append(idx[cut:])
            replay.append(idx[:shots])
        else:
            new_train.append(idx[:shots])
            new_test.append(idx[shots:])
    pick = lambda parts: (x[torch.cat(parts)], y[torch.cat(parts)])  # noqa: E731
    return pick(pre), pick(old_test), pick(new_train), pick(new_test), pick(replay)


def fit(model: nn.Module, data, epochs: int, lr: float, batch: int, seed: int, teacher: nn.Module | None = None,
        distill: float = 0.0, clip: float | None = None, adaptive: float | None = None) -> None:
    """SGD with Nesterov momentum and a cosine schedule; distillation from ``teacher`` when given; each step's
    gradient clipped unit by unit at the ratio ``adaptive``, then to the norm ``clip``, where given (as the trainer's
    update does)."""
    x, y = data
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = epochs * -(-len(x) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    loss_fn = ContinualLoss(distill=distill)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            if len(idx) < 2:
                continue  # batch norm needs two samples
            xb, yb = x[idx], y[idx]
            targets = (yb,)
            if teacher is not None:
                with torch.no_grad():
                    targets += (teacher(xb),)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xb), *targets).backward()
            if adaptive is not None:
                adaptive_clip_(list(model.parameters()), adaptive)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()


@torch.no_grad()
def accuracy(model: nn.Module, data) -> float:
    model.eval()
    x, y = data
    return float((model(x).argmax(1) == y).float().mean())


def _tune_imported(model: nn.Module, bn: str, lr: float, clip: float | None, adaptive: float | None, tune, old_test,
                   new_test, a, path: Path) -> dict:
    """Export ``model`` with batch norm kept or folded, import it; for each fine-tuning seed, grow a copy's head,
    fit its new rows, fine-tune with distillation."""
    export(model.eval(), a.fewshot_size, path, keep_bn=bn == "kept")
    out = {"lr": lr, "clip_grad_norm": clip, "adaptive_clip": adaptive}
    try:
        imported = load_imported(path)
        out["start"] = "imported from ONNX"
        out["batch_norms"] = sum(isinstance(m, nn.BatchNorm2d) for m in imported.modules())
        out["imported_old"] = accuracy(imported, old_test)
    except Missing as e:
        imported = copy.deepcopy(model)
        out["start"] = f"the PyTorch model (the import is missing: {e})"
    teacher = copy.deepcopy(imported).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    classes = tuple(str(c) for c in range(10))
    runs = []
    for seed in fewshot_seeds(a):
        base = copy.deepcopy(imported)
        torch.manual_seed(seed)  # the grown rows' initialization
        grow_head(base, classes[:5], classes)
        run = {"seed": seed}
        start = time.perf_counter()
        if a.probe:  # the trainer's continual.probe: the new rows fitted to the imported features first (on every
            # image: the set has 20 of each class, fewer than the trainer's PROBE_IMAGES)
            run["probe"] = fit_new_rows(base, head_inputs(base, tune[0].split(256)), tune[1], 5, 5e-4)
        fit(base, tune, a.finetune_epochs, lr, 20, seed, teacher=teacher, distill=1.0, clip=clip, adaptive=adaptive)
        run["finetune_seconds"] = round(time.perf_counter() - start, 1)
        run["new"], run["old"] = accuracy(base, new_test), accuracy(base, old_test)
        if not runs and out["start"] == "imported from ONNX":
            from edgerev.export.imported import export_imported

            out["export_back_max_abs_diff"] = export_imported(base, path.with_suffix(".tuned.onnx")).max_abs_diff
        runs.append(run)
    return {**out, **_means(runs), "runs": runs}


def fewshot_seeds(a) -> range:
    """The fine-tuning seeds (batch order, grown rows, random weights): ``--seed`` and the next ones."""
    return range(a.seed, a.seed + a.fewshot_seeds)


def _means(runs: list[dict]) -> dict:
    return {k: round(statistics.mean(r[k] for r in runs), 4) for k in ("new", "old")}


def fewshot(name: str, a, tmp: Path) -> dict:
    torch.manual_seed(a.seed)
    pre, old_test, new_train, new_test, replay = split_digits(a.fewshot_size, a.shots, a.seed)
    tune = (torch.cat([new_train[0], replay[0]]), torch.cat([new_train[1], replay[1]]))
    model = DESIGNS[name](num_classes=5, width=a.fewshot_width)
    start = time.perf_counter()
    fit(model, pre, a.pretrain_epochs, a.lr, 32, a.seed)
    out = {"pretrain_seconds": round(time.perf_counter() - start, 1), "pretrained_old": accuracy(model, old_test),
           "pretrain_images": len(pre[0]), "finetune_images": len(tune[0]), "old_test": len(old_test[0]),
           "new_test": len(new_test[0])}
    from edgerev.train.config import DEFAULT_ADAPTIVE_CLIP, DEFAULT_CLIP, DEFAULT_LR

    for bn, start in (("kept", "pretrained"), ("folded", "folded")):  # the trainer's recipe for each: its rate
        lr = a.finetune_lr * DEFAULT_LR[start] / DEFAULT_LR["pretrained"]  # relative to --finetune-lr, and its clip
        try:
            out[f"bn_{bn}"] = _tune_imported(model, bn, lr, DEFAULT_CLIP[start], DEFAULT_ADAPTIVE_CLIP[start], tune,
                                             old_test, new_test, a, tmp / f"{name}-digits-{bn}.onnx")
        except Exception as e:  # an import that refuses one export still leaves the other's figures
            out[f"bn_{bn}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    runs = []
    for seed in fewshot_seeds(a):
        torch.manual_seed(seed)
        scratch = DESIGNS[name](num_classes=10, width=a.fewshot_width)
        fit(scratch, tune, a.finetune_epochs, a.finetune_lr, 20, seed)
        runs.append({"seed": seed, "new": accuracy(scratch, new_test), "old": accuracy(scratch, old_test)})
    out["random"] = {**_means(runs), "runs": runs}
    return out


def same_time(figs: dict) -> dict | None:
    """torch's budget whose step-time ratio is nearest edgerev's plan at half the plain peak, side by side."""
    t, e = figs.get("torch", {}).get("budgets"), figs.get("time", {})
    if not t or "time_ratio" not in e:
        return None
    budget, fig = min(t.items(), key=lambda kv: abs(kv[1]["time_ratio"] - e["time_ratio"]))
    return {"edgerev_time_ratio": e["time_ratio"], "edgerev_peak_bytes": e["predicted_peak_bytes"],
            "torch_budget": float(budget), "torch_time_ratio": fig["time_ratio"], "torch_peak_bytes": fig["peak_bytes"],
            "torch_peak_ratio": fig["peak_ratio"]}


# ---- the run -----------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--designs", default=",".join(DESIGNS))
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=float, default=1.0, help="width multiplier of the designs (1.0: published)")
    p.add_argument("--device", default="cpu", help="where the torch part runs (cuda: inductor and the allocator)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="activation_memory_budget values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fewshot-seeds", type=int, default=3, help="fine-tuning seeds per few-shot run (means reported)")
    p.add_argument("--shots", type=int, default=20)
    p.add_argument("--fewshot-size", type=int, default=32)
    p.add_argument("--fewshot-width", type=float, default=0.5)
    p.add_argument("--pretrain-epochs", type=int, default=8)
    p.add_argument("--finetune-epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--finetune-lr", type=float, default=0.01)
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=ContinualConfig().probe,
                   help="fit an import's new head rows to its features before fine-tuning, as the trainer's "
                        "continual.probe does (default: the trainer's default)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    a.budgets = [float(b) for b in a.budgets.split(",") if b]
    names = [n for n in a.designs.split(",") if n]
    parts = [q for q in a.parts.split(",") if q]
    unknown = sorted(set(names) - set(DESIGNS)) + sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown design or part: {', '.join(unknown)}")
    result = {"size": a.size, "batch": a.batch, "width": a.width, "device": a.device, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "args": {k: v for k, v in vars(a).items() if k != "out"}, "designs": {n: {} for n in names}}
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            for name in names:
                start = time.perf_counter()
                print(f"{part} {name} ...", file=sys.stderr, flush=True)
                try:
                    if part == "fidelity":
                        fig = fidelity(name, a, Path(tmp))
                    elif part == "memory":
                        fig = memory(name, a)
                    elif part == "torch":
                        fig = torch_budget(name, a)
                    elif part == "time":
                        fig = half_budget_time(name, a)
                    else:
                        fig = fewshot(name, a, Path(tmp))
                except Missing as e:
                    fig = {"missing": str(e)}
                except Exception as e:  # one design's failure is a figure too; the others still run
                    fig = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           "traceback": traceback.format_exc(limit=4).splitlines()[-6:]}
                fig["wall_seconds"] = round(time.perf_counter() - start, 1)
                result["designs"][name][part] = fig
                if a.out:
                    a.out.parent.mkdir(parents=True, exist_ok=True)
                    a.out.write_text(__import__("json").dumps(result, indent=2) + "\n")
    for figs in result["designs"].values():
        figs["same_time"] = same_time(figs)
    write_json(result, a.out)


if __name__ == "__main__":
    main()
