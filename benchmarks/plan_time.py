"""How long planning takes, in CPU seconds, per model and input size, as JSON.

Each case is ``edgerev.plan`` of one model at one size and step batch, run cold in a process of its own (an empty
profile cache, nothing planned before in the process), timed with ``time.process_time()`` (CPU seconds of the
process: a loaded machine stretches the wall clock far more than the CPU time):

* ``estimate``: the plan from estimated stage costs (fake tensors), as ``edgerev plan --estimate``;
* ``verify``: the plan from measured stage costs and two real steps with it, as ``edgerev plan --verify``.

The planner's phases are timed apart (``phases``, from its progress callback), and with ``--profile`` the
heaviest functions of a case are listed from cProfile (cumulative seconds), to show where the time goes.
Targets (issue 34): estimate at most 10 s of CPU, verify at most 30 s.

    python benchmarks/plan_time.py --out results/plan_time.json
    python benchmarks/plan_time.py --models tv:mobilenet_v2 --sizes 64 --kinds estimate --profile 25
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json

MODELS = ("revnext", "revnet", "designs:mobilenet_v2", "designs:resnet18", "designs:efficientnet_b0",
          "tv:mobilenet_v2", "tv:resnet18", "tv:efficientnet_b0")
SIZES = (64, 224)
KINDS = ("estimate", "verify")
BATCH = 8
TARGETS = {"estimate": 10.0, "verify": 30.0}


def build(name: str):
    """The module for a benchmark name: a registry name, ``designs:<fn>``, ``tv:<fn>`` (torchvision) or ``timm:<name>``
    (10 classes)."""
    import torch

    torch.manual_seed(0)
    if name.startswith("designs:"):
        from edgerev.models import designs

        return getattr(designs, name.split(":", 1)[1])(num_classes=10)
    if name.startswith("tv:"):
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": True} if name == "tv:googlenet" else {}
        return getattr(torchvision.models, name.split(":", 1)[1])(num_classes=10, **kwargs)
    if name.startswith("timm:"):
        import timm

        return timm.create_model(name.split(":", 1)[1], pretrained=False, num_classes=10)
    return name


def budget_for(model, size: int) -> int:
    """A budget that leaves the step's activations little room: the weights, their gradients and momentum, the batch,
    and 16 MiB (64x64) or 128 MiB (224x224) beside them, rounded up to a MiB."""
    from edgerev.models.resolve import resolve_model

    net = resolve_model(model).module
    held = 3 * sum(p.numel() * p.element_size() for p in net.parameters()) + BATCH * 3 * size * size * 4
    return -(-(held + (16 if size <= 64 else 128) * 2**20) // 2**20) * 2**20


def one(name: str, size: int, kind: str, profile: int) -> dict:
    """One case, in this process (the child)."""
    import cProfile
    import pstats

    import torch

    from edgerev.api import plan

    try:
        from edgerev.memory.plan.progress import Progress
    except ImportError:
        Progress = None  # noqa: N806

    torch.set_num_threads(1)  # CPU seconds of one thread: comparable on a shared machine
    model = build(name)
    phases: list[dict] = []
    last = [time.process_time()]

    def progress(line: str) -> None:  # each phase's CPU seconds are those until the next begins
        now = time.process_time()
        if phases:
            phases[-1]["cpu_seconds"] = round(now - last[0], 3)
        phases.append({"phase": line.split(": ", 1)[1].rsplit(" (", 1)[0]})
        last[0] = now

    budget = budget_for(model, size)
    prof = cProfile.Profile() if profile else None
    t0, w0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    error = None
    # every phase, from the first second (a planner from before progress existed is timed whole: the before figures)
    report = {"progress": Progress(progress, after=0)} if Progress is not None else {}
    try:
        p = plan(model, size=size, budget=budget, batch=BATCH, estimate=kind == "estimate",
                 verify=kind == "verify", **report)
    except Exception as e:  # noqa: BLE001  (a case that fails is recorded with its reason, not hidden)
        error, p = f"{type(e).__name__}: {e}", None
    if prof:
        prof.disable()
    if phases:
        phases[-1]["cpu_seconds"] = round(time.process_time() - last[0], 3)
    row = {"model": name, "size": size, "kind": kind, "batch": BATCH, "budget_bytes": budget,
           "cpu_seconds": round(time.process_time() - t0, 3), "wall_seconds": round(time.perf_counter() - w0, 3),
           "target_cpu_seconds": TARGETS[kind], "phases": phases}
    if error:
        row["error"] = error
    else:
        s = p.summary
        row.update(micro_batch=p.batch, predicted_peak_bytes=p.predicted_peak_bytes, planner=s["planner"],
                   modes=[st["mode"] for st in s["stages"]],
                   slices=[st.get("slice_bytes") for st in s["stages"]],
                   segments=s.get("segments"), measured_peak_bytes=s.get("measured_peak_bytes"))
        row["met"] = row["cpu_seconds"] <= TARGETS[kind]
    if prof:
        stats = pstats.Stats(prof)
        rows = sorted(((v[3], f"{Path(k[0]).name}:{k[1]}:{k[2]}") for k, v in stats.stats.items()), reverse=True)
        row["profile"] = [{"function": f, "cumulative_seconds": round(c, 3)} for c, f in rows[:profile]]
    return row


def run_case(name: str, size: int, kind: str, profile: int) -> dict:
    """One case in a fresh process with an empty profile cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "EDGEREV_CACHE": cache, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--child", name, str(size), kind, "--profile", str(profile)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"model": name, "size": size, "kind": kind, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--profile", type=int, default=0, help="list this many functions of cProfile per case")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "SIZE", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.child[0], int(a.child[1]), a.child[2], a.profile)))
        return
    rows = []
    for name in a.models:
        for size in a.sizes:
            for kind in a.kinds:
                rows.append(run_case(name, size, kind, a.profile))
                print(json.dumps({k: rows[-1].get(k) for k in ("model", "size", "kind", "cpu_seconds", "error")}),
                      file=sys.stderr, flush=True)
    met = [r.get("met", False) for r in rows]
    write_json({"batch": BATCH, "targets_cpu_seconds": TARGETS, "cases": rows,
                "met": sum(met), "of": len(met)}, a.out)


if __name__ == "__main__":
    main()
