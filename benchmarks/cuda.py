"""The CUDA campaign in one command: what no CPU run of this project can measure, written as JSON.

    PYTHONPATH=. python benchmarks/cuda.py --out results/cuda.json 2>&1 | tail -50

Runs from the source tree with torch, numpy, onnx, safetensors, pyyaml, pillow and matplotlib (no Flower,
onnxscript or hypothesis needed) inside ``--budget-seconds`` (460, under 8 minutes). Its parts
(``cuda_parts.py``):

* ``memory``: every registry model in every engine mode it supports, one training step at batch 32,
  240x240: CUDA's peak allocated and reserved bytes (``max_memory_allocated`` / ``max_memory_reserved``)
  and the step's time; the live-tensor tracker counts the same step on the CUDA tensors where the step
  took at most ``--tracker-seconds`` (its dispatch costs several times the step, and the engine's batch
  slices of temporaries make a RevNeXt step at 240x240 some 380,000 ops in invert mode, 2.3 million in
  floor mode: seconds of kernel launches);
* ``predict``: the fake-tensor prediction (``fake_step_peak``) of each of those steps, in ``--workers``
  processes beside the GPU parts (the same tracker on fake tensors: tens of CPU seconds for RevNeXt at
  240x240, minutes in floor mode), with what cuBLAS and each convolution take on the device, measured there
  as a CUDA plan counts them (``edgerev.memory.measure.workspaces``);
* ``profile``: the planner's per-stage profile of the GTX 750 recipe's model on this GPU (beside the others);
* ``cap`` and ``cap_expandable``: ``configs/gtx750.yaml`` (RevNeXt width 32, 32x32, SGD with momentum,
  clipping) with steps of 256 samples as the daemon's GTX 750 preset, under the 400 MiB cap, planned and
  enforced as the trainer does (``plan_memory``: ``set_per_process_memory_fraction``): ``--steps`` steps
  at the planner's micro-batch without an out-of-memory error, then a forced micro-batch (twice the
  plan's, doubling) until one runs out of memory and must recover by halving without losing the step, and
  the reserved peak against the cap; once with ``PYTORCH_CUDA_ALLOC_CONF`` unset, as the daemon runs
  (nothing in edgerev, its daemon or deploy/ sets it: the allocator's default, no expandable segments),
  and once with ``expandable_segments:True``;
* ``step_time``: step time of each mode against plain autograd, same weights, interleaved, at 32x32 and
  batch 32 (``step_time.py``), with each mode's kernel ops per step (counted on the meta device by the CPU,
  ``kernels.py``); beside them the same ratios at the memory part's batch 32, 240x240, from its one step per
  mode and plain autograd's (the memory part times both alike);
* ``train``: the same recipe under its cap on the generated data set (no download): accuracy and wall
  time, with as many epochs (at most ``--epochs``) as the cap part's step time fits in half its limit.

Each part runs in a process of its own (an out-of-memory error, a CUDA error or an allocator setting,
which must be set before CUDA starts, stays in its part) with a time limit inside the overall budget; a
part that fails or overruns is recorded with its error and log, and the campaign goes on. The JSON is
rewritten as each part ends (a part's finished rows too), so a kill loses nothing measured. The last lines
printed are a summary of the figures.

Expected on one H100 (estimated, never run): environment 10 s; memory 1-2 min, mostly RevNeXt's sliced
steps (floor alone ~20 s); profile, predict in the background; each cap part under a minute; step time
under a minute; train about a minute: some 4-5 minutes, and parts that overrun are cut at their limits.

``--device cpu`` is a dry run of every code path but the allocator's: the tracker's figures stand in for
the allocator's and the cap is the tracker's, as the trainer enforces it on CPU. Make it small with
``--models``, ``--size``, ``--batch``, ``--width``, ``--steps``, ``--recipe-args`` and friends
(tests/test_cuda_campaign.py runs one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import write_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXPANDABLE = "expandable_segments:True"


@dataclass
class Part:
    """One part of the campaign: which measurement, under which allocator setting, for how long at most."""

    name: str
    run: str  # the function in cuda_parts.PARTS
    limit: float
    alloc_conf: str | None = None
    background: bool = False
    plans: bool = False  # it plans from the profile part's measurement: waits for it, and --only brings it


def parts(args: argparse.Namespace) -> list[Part]:
    return [
        Part("environment", "environment", 60),
        Part("predict", "predict", args.budget_seconds, background=True),
        Part("profile", "profile", 300, background=True),
        Part("memory", "memory", 170),
        Part("cap", "cap", 80, plans=True),
        Part("cap_expandable", "cap", 80, alloc_conf=EXPANDABLE, plans=True),
        Part("step_time", "step_time", 60),
        Part("train", "train", 110, plans=True),
    ]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="the JSON file to write (rewritten as each part ends)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda, or cpu for a dry run")
    p.add_argument("--models", default=None, help="comma-separated registry names (default: all)")
    p.add_argument("--batch", type=int, default=32, help="memory and step-time batch (default 32)")
    p.add_argument("--size", type=int, default=240, help="memory and step-time input size (default 240)")
    p.add_argument("--width", type=int, default=None, help="a width for every model (default: each model's)")
    p.add_argument("--tracker-seconds", type=float, default=0.5,
                   help="count a CUDA step with the tracker too when it took at most this (default 0.5 s)")
    p.add_argument("--time-batch", type=int, default=32, help="step-time batch (default 32)")
    p.add_argument("--time-size", type=int, default=32, help="step-time input size (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per variant (default 3)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20,
                   help="batch-slice budget of the engine's temporaries (default 1 MiB, the library's; 0: never)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes for the fake-tensor predictions (default: the cores less four, at most 10)")
    p.add_argument("--cap", default="400MiB", help="the cap of the cap and training parts (default 400MiB)")
    p.add_argument("--steps", type=int, default=50, help="steps at the planner's micro-batch (default 50)")
    p.add_argument("--forced-tries", type=int, default=6, help="doublings of the forced micro-batch (default 6)")
    p.add_argument("--recipe-size", type=int, default=None, help="the recipe's input size (default its own, 32)")
    p.add_argument("--recipe-batch", type=int, default=256,
                   help="samples per step (default 256, the daemon's GTX 750 preset; the recipe's is 512)")
    p.add_argument("--recipe-args", type=json.loads, default={},
                   help='JSON merged into the recipe model\'s arguments, e.g. \'{"width": 8}\'')
    p.add_argument("--profile", default="measure", choices=("measure", "estimate"),
                   help="the planner's stage costs: measured on this device (default) or estimated")
    p.add_argument("--epochs", type=int, default=6,
                   help="epochs of the training part, at most (default 6; fewer if the cap part's step time says "
                        "they would not fit half the part's limit)")
    p.add_argument("--train-samples", type=int, default=6000, help="generated training images (default 6000)")
    p.add_argument("--budget-seconds", type=float, default=460, help="the whole campaign's limit (default 460)")
    p.add_argument("--only", default=None, help="comma-separated parts to run (default: all); cap, cap_expandable and "
                   "train bring the profile they plan from")
    p.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    p.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--part-seconds", type=float, default=60.0, help=argparse.SUPPRESS)  # its limit
    p.add_argument("--train-step-seconds", type=float, default=None, help=argparse.SUPPRESS)  # the cap part's
    p.add_argument("--size-steps", type=json.loads, default=None, help=argparse.SUPPRESS)  # the memory part's
    args = p.parse_args(argv)
    if args.models is None:
        from edgerev.models import list_models

        args.models = list_models()
    else:
        args.models = [m for m in args.models.split(",") if m]
    args.overrides = {"width": args.width} if args.width else {}
    args.workers = args.workers or max(1, min(10, (os.cpu_count() or 1) - 4))
    from edgerev.sizes import parse_bytes  # no torch

    args.cap = parse_bytes(args.cap)
    return args


def _kill(proc: subprocess.Popen) -> None:
    """The part's whole process group (the prediction's workers too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Campaign:
    def __init__(self, args: argparse.Namespace, argv: list[str], work: Path) -> None:
        self.args, self.argv, self.work = args, argv, work
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_seconds
        self.running: dict[str, tuple[subprocess.Popen, Part, float, float]] = {}
        self.result = {
            "campaign": "cuda", "device": args.device,
            "command": "PYTHONPATH=. python benchmarks/cuda.py " + shlex.join(argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_seconds": args.budget_seconds,
            "inherited_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "daemon_alloc_conf": "unset: nothing in edgerev, daemon/ or deploy/ sets PYTORCH_CUDA_ALLOC_CONF, "
                                 "so the daemon runs with the allocator's default (no expandable segments)",
            "parts": {},
        }

    def save(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.start, 1)
        if self.args.out:
            self.args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.result, indent=2) + "\n")
            tmp.replace(self.args.out)

    def launch(self, part: Part, extra: tuple[str, ...] = ()) -> None:
        left = self.deadline - time.monotonic()
        if left < 5:
            self.result["parts"][part.name] = {"status": "skipped", "error": "the campaign's budget was spent"}
            self.save()
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "EDGEREV_CACHE": str(self.work / "cache")}
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if part.alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = part.alloc_conf
        out = self.work / f"{part.name}.json"
        limit = min(part.limit, left)
        cmd = [sys.executable, str(Path(__file__).resolve()), *self.argv, "--part", part.run, "--part-out", str(out),
               "--part-seconds", str(limit), *extra]
        log = (self.work / f"{part.name}.log").open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.running[part.name] = (proc, part, time.monotonic(), limit)
        print(f"[{self._clock()}] {part.name}: started (limit {limit:.0f} s)", flush=True)

    def wait(self, name: str) -> None:
        """Wait for part ``name`` until its limit, record it, and write the JSON."""
        if name not in self.running:
            return
        proc, part, started, limit = self.running.pop(name)
        status, error = "ok", None
        try:
            proc.wait(timeout=max(0.0, started + limit - time.monotonic()))
            if proc.returncode != 0:
                status, error = "failed", f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            _kill(proc)
            status, error = "timed_out", f"over its limit of {limit:.0f} s"
        entry: dict = {"status": status, "seconds": round(time.monotonic() - started, 1)}
        if part.alloc_conf:
            entry["alloc_conf"] = part.alloc_conf
        out = self.work / f"{part.name}.json"
        if out.exists():
            entry["result"] = json.loads(out.read_text())
            if part.background and "part_seconds" in entry["result"]:  # its own time, not when it was waited for
                entry["seconds"] = entry["result"]["part_seconds"]
        if error:
            tail = (self.work / f"{part.name}.log").read_text(errors="replace")[-3000:]
            entry.update(error=error, log_tail=tail)
        self.result["parts"][name] = entry
        self.save()
        print(f"[{self._clock()}] {name}: {status} in {entry['seconds']} s" + (f" ({error})" if error else ""),
              flush=True)

    def step_seconds(self) -> tuple[str, ...]:
        """The recipe's step time as the cap part measured it: the training part sizes its run by it."""
        planned = self.result["parts"].get("cap", {}).get("result", {}).get("planned", {})
        seconds = planned.get("seconds_per_step") if planned.get("steps") else None
        return ("--train-step-seconds", str(seconds)) if seconds else ()

    def size_steps(self) -> tuple[str, ...]:
        """Each model's step seconds per mode and plain autograd's at the memory part's size, as it measured them:
        the step-time part reports their ratios beside its own."""
        mem = self.result["parts"].get("memory", {}).get("result", {})
        steps: dict[str, dict] = {}
        for arch, row in mem.get("plain", {}).items():
            if "step_seconds" in row:
                steps.setdefault(arch, {})["plain"] = row["step_seconds"]
        for row in mem.get("rows", []):
            if "step_seconds" in row:
                steps.setdefault(row["arch"], {})[row["mode"]] = row["step_seconds"]
        return ("--size-steps", json.dumps(steps)) if steps else ()

    def _clock(self) -> str:
        return f"{time.monotonic() - self.start:5.0f} s"

    def stop_all(self) -> None:
        for proc, *_ in self.running.values():
            _kill(proc)


def selected(args: argparse.Namespace) -> list[Part]:
    """The parts ``--only`` names (all by default), with the profile the cap and training parts plan from:
    without it each would measure the profile itself, inside its own limit (95 s on an H200, over the cap
    part's 80 s).

    Raises:
        SystemExit: ``--only`` names a part that does not exist."""
    every = parts(args)
    if not args.only:
        return every
    only = {name.strip() for name in args.only.split(",")}
    unknown = only - {p.name for p in every}
    if unknown:
        raise SystemExit(f"--only: no part {', '.join(sorted(unknown))}; the parts: "
                         f"{', '.join(p.name for p in every)}")
    if any(p.plans for p in every if p.name in only):
        only.add("profile")
    return [p for p in every if p.name in only]


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    plan = selected(args)
    with tempfile.TemporaryDirectory(prefix="edgerev-cuda-") as tmp:
        c = Campaign(args, argv, Path(tmp))
        c.save()
        try:
            for p in plan:
                if p.background:
                    c.launch(p)
            for p in plan:
                if p.background:
                    continue
                if p.plans:
                    c.wait("profile")  # measured once, not by each
                extra = {"train": c.step_seconds, "step_time": c.size_steps}.get(p.name, tuple)()
                c.launch(p, extra)
                c.wait(p.name)
            for name in list(c.running):
                c.wait(name)
        finally:
            c.stop_all()
        c.save()
        return c.result


# ---- the summary printed last -------------------------------------------------------------------------------------

def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _step_line(r: dict) -> str:
    """One model's step-time ratios: at the step-time size [its kernel ops there] | at the memory part's size."""
    ops = r.get("kernel_ops", {})
    big = r.get("at_size", {})
    big_rel, big_s = big.get("relative_to_plain", {}), big.get("step_seconds", {})
    cells = []
    for v, x in r["relative_to_plain"].items():
        if v == "plain":
            continue
        cell = f"{v} {x:.2f}" + (f" [{ops[v]:,}]" if v in ops else "")
        cells.append(cell + (f" | {big_rel[v]:.2f}" if v in big_rel else ""))
    plain = f"plain {r['median_seconds']['plain'] * 1e3:.1f} ms" + (f" [{ops['plain']:,}]" if "plain" in ops else "")
    plain += f" | {big_s['plain'] * 1e3:.0f} ms" if "plain" in big_s else ""
    return f"  {r['arch']:<10} {plain}; {', '.join(cells)}"


def summary(result: dict) -> list[str]:
    parts_ = result["parts"]
    lines = [f"CUDA campaign on {result['device']} ({result['seconds']} s): "
             + ", ".join(f"{k} {v['status']}" for k, v in parts_.items())]
    env = parts_.get("environment", {}).get("result", {})
    lines.append(f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), GPU {env.get('gpu', '-')}, "
                 f"driver {env.get('driver') or '-'}, Python {env.get('python')}")
    mem = parts_.get("memory", {}).get("result", {})
    pred = {(r["arch"], r["mode"]): r for r in parts_.get("predict", {}).get("result", {}).get("rows", [])}
    if mem:
        lines.append(f"memory, one step at batch {mem['batch']}, {mem['size']}x{mem['size']} (MiB; tracker counted "
                     f"on {mem['tracker_on']} tensors; predicted: fake tensors; step: the allocator's step, s):")
        lines.append(f"  {'model':<10} {'mode':<9} {'allocated':>10} {'reserved':>10} {'tracker':>10} "
                     f"{'predicted':>10} {'alloc/pred':>10} {'step':>7}")
        order = ("invert", "floor", "recompute", "store", "store8", "store4")
        for r in sorted(mem["rows"], key=lambda r: (r["arch"], order.index(r["mode"]) if r["mode"] in order else 9)):
            p = pred.get((r["arch"], r["mode"]), {}).get("predicted_peak_bytes")
            if "error" in r:
                lines.append(f"  {r['arch']:<10} {r['mode']:<9} error: {r['error'][:70]}")
                continue
            ratio = f"{r['allocated_peak_bytes'] / p:.3f}" if p else "-"
            lines.append(f"  {r['arch']:<10} {r['mode']:<9} {_mb(r['allocated_peak_bytes']):>10} "
                         f"{_mb(r['reserved_peak_bytes']):>10} {_mb(r.get('tracker_peak_bytes')):>10} "
                         f"{_mb(p):>10} {ratio:>10} {r['step_seconds']:>7.2f}")
    st = parts_.get("step_time", {}).get("result", {})
    if st:
        at = st.get("at_size", {})
        lines.append(f"step time relative to plain autograd at batch {st['batch']}, {st['size']}x{st['size']} "
                     f"[kernel ops per step there] | at batch {at.get('batch')}, {at.get('size')}x{at.get('size')}:")
        for r in st["rows"]:
            if "error" in r:
                lines.append(f"  {r['arch']:<10} error: {r['error'][:80]}")
                continue
            lines.append(_step_line(r))
    for name in ("cap", "cap_expandable"):
        c = parts_.get(name, {}).get("result")
        if not c or "planned" not in c:
            continue
        pl = c["planned"]
        forced = c.get("forced", [])
        last = forced[-1] if forced else {}
        lines.append(f"{name} ({c['alloc_conf'] or 'allocator default'}): cap {_mb(c['cap_bytes'])} MiB, "
                     f"micro-batch {c['micro_batch']} of {c['batch']}, predicted {_mb(c['predicted_peak_bytes'])}; "
                     f"{pl['steps']} steps, {pl['oom_retries']} OOM retries, allocated "
                     f"{_mb(pl.get('allocated_peak_bytes'))}, reserved {_mb(pl.get('reserved_peak_bytes'))}; "
                     f"{1000 * pl['seconds_per_step']:.1f} ms a step")
        lines.append(f"  forced micro-batch {last.get('batch')}: retries {last.get('retries')}, ran as "
                     f"{last.get('micro_batches')} micro-batches, stepped {last.get('stepped')}; recovered "
                     f"{c.get('recovered')}; part peaks allocated {_mb(c.get('allocated_peak_bytes'))}, reserved "
                     f"{_mb(c.get('reserved_peak_bytes'))}, under the cap {c.get('reserved_under_cap', '-')}")
    t = parts_.get("train", {}).get("result")
    if t and "final" in t:
        lines.append(f"train: {t['arch']} {t['args']} at {t['size']}x{t['size']}, {t['epochs']} epochs of "
                     f"{t['train_samples']} generated images under {_mb(t['cap_bytes'])} MiB: accuracy "
                     f"{t['final']['acc']:.4f} in {t['seconds']} s ({t['steps']} steps, micro-batch "
                     f"{t['plan'].get('micro_batch')}; CUDA graphs {t['plan'].get('cuda_graphs')})")
    for name, p in parts_.items():
        if p["status"] != "ok":
            lines.append(f"{name}: {p['status']}: {p.get('error')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.part:
        from cuda_parts import run_part

        run_part(args.part, args, args.part_out)
        return 0
    result = run(args, argv)
    write_json(result, args.out)
    print("\n".join(summary(result)))
    return 0 if all(p["status"] == "ok" for p in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
