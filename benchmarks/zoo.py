"""The edge model zoo trains (issue 34, item 2): torchvision's and timm's classifiers, each through every route.

For each model (random weights, ``--classes`` 10, ``--batch`` 8) and each route:

- ``torch``: the ``nn.Module`` itself, given to :func:`edgerev.plan` and :func:`edgerev.fit`, its batch-norm
  statistics their defaults, as a network built with random weights has them (so the trainer takes it as a new
  model: statistics moved off their defaults say pretrained, and a random network fine-tuned at the pretrained
  rate, 0.01 with Nesterov momentum, rose in loss for ResNet-50, RegNetX, EfficientNet-B0 and MNASNet at batch 8,
  as plain PyTorch's loop with the same optimizer did);
- ``dynamo``: the module exported by torch's dynamo exporter (``torch.onnx.export(dynamo=True)``, dynamic batch,
  batch norm folded as its default ``optimize=True`` does), brought as an ``.onnx`` file;
- ``legacy``: the module exported by the TorchScript exporter (``dynamo=False``, its default constant folding),
  brought as an ``.onnx`` file;

each file exported from the module after :func:`calibrate` (as a trained network's statistics would be). At each
``--sizes`` (64; 224 with ``--sizes 64,224``, heavy on two cores), one run is, as a user would do it with the
public API:

1. plan: :func:`edgerev.plan` with estimated costs, once at a budget that holds everything (its peak is the
   store-everything step) and once at ``--fraction`` of that peak, every parameter training with its momentum;
   where that is below the planner's floor (``fraction_refused_all``), with ``trainable="auto"`` (the most parameters
   that fit, the momentum in bfloat16 or dropped: ``fraction_trainable``, ``fraction_optimizer_state``), and where
   even that is refused (``fraction_refused``) the run goes on under the first budget; with ``--time``, a step of
   the plan at the fraction (``edgerev.plan(verify=True)``: real steps of its micro-batch) against plain autograd's
   step of the same model (``step_time_ratio``; the issue's figure is at most 1.5 at ``--fraction 0.5``, 224x224);
2. train: :func:`edgerev.fit` under that budget and trainable set, ``--epochs`` epochs over ``--samples``
   generated images (so the loss must fall: the same images come back each epoch), every step's loss logged;
   finite, and the mean of the last two steps below the mean of the first two;
3. export: :func:`edgerev.export.export_onnx` (the trained module with the run's ``ModelInfo`` for ``torch``, the
   run directory for the files: it writes the trained weights back into the original graph);
4. check: ONNX Runtime on the exported file against the trained module (``torch``: the module ``fit`` trained
   in place; files: the run directory resolved again) on normalized random pixels, and for the files, that the
   exported file keeps the original's input and output names (a module has no names of its own).

Each run is a child process under a CPU-time limit (``--cpu-limit``) and ends as one of: ``ok``; ``refused`` (an
:class:`edgerev.errors.EdgerevError`: its one line and the stage); ``crashed`` (any other exception: its type,
message and the last frames); ``failed`` (a check above: what it saw); ``timeout`` (the CPU limit); ``no-file``
(torch's own exporter could not write the file the route starts from: not edgerev's to train). The summary gives
the fraction ``ok`` (the issue's target: at least 90 %) and lists every other outcome.

    OMP_NUM_THREADS=1 python benchmarks/zoo.py --out zoo-64.json
    OMP_NUM_THREADS=1 python benchmarks/zoo.py --models resnet18,mobilevit_xxs --routes torch --sizes 64
    OMP_NUM_THREADS=1 python benchmarks/zoo.py --sizes 224 --cpu-limit 1800 --out zoo-224.json
    OMP_NUM_THREADS=1 python benchmarks/zoo.py --sizes 224 --routes torch --fraction 0.5 --time --out zoo-half.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import math
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import quiet, write_json

#: name -> library; the torchvision names are ``torchvision.models`` builders, the timm names ``timm.create_model``'s
MODELS = {
    **{n: "torchvision" for n in (
        "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large", "resnet18", "resnet50", "efficientnet_b0",
        "shufflenet_v2_x1_0", "squeezenet1_1", "mnasnet0_5", "regnet_x_400mf", "densenet121", "convnext_tiny",
        "googlenet")},
    **{n: "timm" for n in (
        "mobilenetv3_small_050", "efficientnet_lite0", "ghostnet_050", "lcnet_050", "rexnet_100", "tinynet_e",
        "regnetx_002", "convnext_atto", "mobileone_s0", "repvit_m0_9", "mobilevit_xxs", "edgenext_xx_small",
        "fastvit_t8", "efficientformerv2_s0")},
}
ROUTES = ("torch", "dynamo", "legacy")
#: the names the files are exported with: the route must give them back
FILE_INPUT, FILE_OUTPUT = "image", "scores"
OUTCOMES = ("ok", "refused", "crashed", "failed", "timeout", "no-file")


class CheckFailed(Exception):
    """A run went through but one of its checks did not hold."""


class NoFile(Exception):
    """torch's own exporter could not write the file a route starts from."""


def build(name: str, classes: int, size: int, seed: int = 0):
    """The model with random weights (``seed``), ``classes`` outputs, in train mode, its batch-norm statistics
    their defaults (a file is exported from it after :func:`calibrate`)."""
    import torch

    torch.manual_seed(seed)
    if MODELS[name] == "torchvision":
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
        model = torchvision.models.get_model(name, weights=None, num_classes=classes, **kwargs)
    else:
        import timm

        kwargs = {"img_size": size} if name.startswith(("efficientformerv2", "mobilevit")) else {}
        try:
            model = timm.create_model(name, pretrained=False, num_classes=classes, **kwargs)
        except TypeError:  # a family whose constructor takes no input size
            model = timm.create_model(name, pretrained=False, num_classes=classes)
    return model


def calibrate(model, size: int, classes: int, batches: int = 4):
    """Running batch-norm statistics measured on generated images of the kind the runs train on (others than
    theirs: :func:`data`'s, from index 20,000, normalized by their mean and std as the trainer's are), as a model
    trained on them would hold.

    A random network in eval mode keeps the default statistics (mean 0, variance 1), which do not normalize
    anything: through a MobileNetV2 its logits shrink to 1e-10, and a file exported from it (batch norm folded)
    is a network that cannot learn. Pretrained files are not like that. The batch norms alone run in training
    mode: statistics measured under stochastic depth's scaling (x / 0.8 on the paths kept) do not normalize
    what inference computes. Nor do statistics of Gaussian noise: EfficientNet-B0's file, calibrated on it,
    gave logits of 2,456 on the generated images and started at a loss of 412."""
    import torch
    from torch import nn

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches below
    model.eval()  # dropout and stochastic depth as inference runs them: the statistics are inference's
    for m in norms:
        m.train()
    images = _generated(size, 8 * batches, classes, 20_000).images.float() / 255
    images = (images - images.mean(dim=(0, 2, 3), keepdim=True)) / images.std(dim=(0, 2, 3), keepdim=True)
    with torch.no_grad():
        for chunk in images.split(8):
            model(chunk)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    return model


def export_file(model, size: int, path: Path, route: str) -> None:
    """``torch.onnx.export`` of ``model`` in eval mode, as its owner would call it."""
    import torch

    model.eval()
    example = (torch.zeros(2, 3, size, size),)
    try:
        with quiet(), torch.no_grad():
            if route == "dynamo":
                torch.onnx.export(model, example, str(path), dynamo=True, external_data=False,
                                  input_names=[FILE_INPUT], output_names=[FILE_OUTPUT],
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
            else:
                torch.onnx.export(model, example, str(path), dynamo=False, input_names=[FILE_INPUT],
                                  output_names=[FILE_OUTPUT], opset_version=17,
                                  dynamic_axes={FILE_INPUT: {0: "batch"}, FILE_OUTPUT: {0: "batch"}})
    except Exception as e:
        raise NoFile(f"{type(e).__name__}: {_first_line(e)}") from None
    finally:
        model.train()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def step_times(source, size: int, budget: int, batch: int, trainable: str = "all", repeats: int = 3) -> dict:
    """A step of ``batch`` samples as the plan under ``budget`` runs it (``edgerev.plan(verify=True)``: real steps
    of its micro-batch, its measured peak, scaled to ``batch`` samples: a batch of 8 planned at micro-batches of 6
    runs as two of 4, not two of 6), against plain autograd's step of the same model (fastest of ``repeats`` after
    a warm-up): the issue's step time at half the plain peak, as a ratio."""
    import torch
    import torch.nn.functional as F

    import edgerev

    p = edgerev.plan(source, size=size, budget=budget, batch=batch, estimate=True, verify=True, trainable=trainable)
    planned = p.summary["measured_step_seconds"] * batch / min(p.batch, batch)
    # a copy: the planned module carries its plan, and the steps below move its batch norms' statistics, which
    # would make the trainer take the random network given to it next for a pretrained one
    module = copy.deepcopy(edgerev.resolve_model(source).module).train()
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 2, (batch,))
    times = []
    for _ in range(repeats + 1):
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        F.cross_entropy(module(x), y).backward()
        times.append(time.perf_counter() - start)
    plain = min(times[1:])
    return {"time_micro_batch": p.batch, "time_measured_peak_bytes": p.summary["measured_peak_bytes"],
            "planned_step_seconds": round(planned, 4), "plain_step_seconds": round(plain, 4),
            "step_time_ratio": round(planned / plain, 3)}


def data(size: int, samples: int, classes: int):
    """``samples`` generated training images and as many held out, one tensor each."""
    return _generated(size, samples, classes, 0), _generated(size, samples, classes, 10_000)


def _generated(size: int, samples: int, classes: int, start: int):
    """``samples`` generated images from index ``start``, one tensor."""
    import torch

    from edgerev.train.data import SyntheticImages
    from edgerev.train.labeled import LabeledImages

    ds = SyntheticImages(samples, num_classes=classes, size=size, seed=0, start=start)
    items = [ds[i] for i in range(len(ds))]
    return LabeledImages(torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items]), ds.classes)


def run(name: str, route: str, size: int, opts: dict, work: Path) -> dict:
    """One (model, route, size): plan, train, export, check; what each stage found, in ``rec`` as it goes."""
    import numpy as np
    import torch

    import edgerev
    from edgerev.export import export_onnx
    from edgerev.memory.solve.costs import BudgetTooSmall
    from edgerev.models.directory import read_info

    rec: dict = {"model": name, "library": MODELS[name], "route": route, "size": size}
    stage = "build"
    try:
        module = build(name, opts["classes"], size)
        source: object = module
        if route != "torch":
            stage = "file"
            source = work / f"{name}-{route}.onnx"
            export_file(calibrate(module, size, opts["classes"]), size, source, route)
        batch = opts["batch"]

        stage = "plan"
        cpu = time.process_time()
        whole = edgerev.plan(source, size=size, budget="64GiB", batch=batch, estimate=True)
        rec["plan_seconds_cpu"] = round(time.process_time() - cpu, 2)
        rec["store_all_peak_bytes"] = whole.predicted_peak_bytes
        budget = int(whole.predicted_peak_bytes * opts["fraction"])
        cpu = time.process_time()
        trainable = "all"
        tight = None
        try:
            tight = edgerev.plan(source, size=size, budget=budget, batch=batch, estimate=True)
        except BudgetTooSmall as e:
            # every weight with its gradient and momentum is more than the fraction: what else the field shrinks
            # (which parameters train, the optimizer's state), as train.trainable auto chooses it
            rec["fraction_refused_all"] = _first_line(e)
            try:
                tight = edgerev.plan(source, size=size, budget=budget, batch=batch, estimate=True, trainable="auto")
                trainable = "auto"
            except BudgetTooSmall as e2:
                rec["fraction_refused"] = _first_line(e2)
                budget = whole.predicted_peak_bytes
        if tight is not None:
            rec["fraction_peak_bytes"] = tight.predicted_peak_bytes
            rec["fraction_segments"] = tight.summary.get("segments") or tight.summary.get("stages")
            rec["fraction_trainable"] = tight.summary.get("trainable", "all")
            rec["fraction_optimizer_state"] = tight.summary.get("optimizer_state", "float32")
        rec["fraction_plan_seconds_cpu"] = round(time.process_time() - cpu, 2)
        rec["budget_bytes"] = budget
        if opts["time"] and "fraction_refused" not in rec:
            stage = "time"
            rec.update(step_times(source, size, budget, batch, trainable))

        stage = "train"
        train, val = data(size, opts["samples"], opts["classes"])
        out = work / f"run-{name}-{route}"
        start = time.perf_counter()
        edgerev.fit(source, (train, val), out=out, budget=budget, size=size, epochs=opts["epochs"], batch=batch,
                    lr=opts["lr"], device="cpu", trainable=trainable,
                    config={"memory": {"profile": "estimate"}, "train": {"log_every": 1, "patience": None},
                            "augment": {"pad": 0, "flip": 0.0}, "optim": {"schedule": "constant"}})
        rec["train_seconds"] = round(time.perf_counter() - start, 2)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if r.get("kind") == "train"]
        rec["losses"] = [round(v, 4) for v in losses]
        if len(losses) < 4 or not all(math.isfinite(v) for v in losses):
            raise CheckFailed(f"train: losses {rec['losses']} (need four or more, all finite)")
        if not sum(losses[-2:]) < sum(losses[:2]):
            raise CheckFailed(f"train: the loss did not fall: {rec['losses']}")

        stage = "export"
        onnx_out = work / f"{name}-{route}-trained.onnx"
        if route == "torch":
            info, _ = read_info(out)
            done = export_onnx(module, onnx_out, info=info)
            trained = module
        else:
            done = export_onnx(out, onnx_out)
            info, _ = read_info(out)
            trained = edgerev.resolve_model(out).module
        rec["exporter"], rec["export_max_abs_diff"] = done.exporter, done.max_abs_diff

        stage = "check"
        import onnxruntime as ort

        session = ort.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"])
        names = ([i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()])
        rec["names"] = names
        if route != "torch" and names != ([FILE_INPUT], [FILE_OUTPUT]):
            raise CheckFailed(f"check: the exported file's names are {names}, the original's "
                              f"{([FILE_INPUT], [FILE_OUTPUT])}")
        rng = np.random.default_rng(1)
        pixels = rng.integers(0, 256, size=(3, len(info.mean), size, size)).astype(np.float32) / 255
        x = ((pixels - np.array(info.mean, np.float32)[:, None, None]) / np.array(info.std, np.float32)[:, None, None])
        got = session.run(None, {names[0][0]: x.astype(np.float32)})[0]
        trained.eval()
        with torch.no_grad():
            ref = trained(torch.from_numpy(x.astype(np.float32))).numpy()
        diff = float(np.abs(got - ref).max())
        rec["ort_max_abs_diff"] = diff
        allowed = 1e-3 * max(1.0, float(np.abs(ref).max()))
        if got.shape != ref.shape or not diff <= allowed:
            raise CheckFailed(f"check: ONNX Runtime {got.shape} against the trained module {ref.shape}: max abs "
                              f"difference {diff:.3g} (allowed {allowed:.3g})")
        rec["outcome"] = "ok"
    except NoFile as e:
        rec.update(outcome="no-file", stage=stage, line=str(e))
    except CheckFailed as e:
        rec.update(outcome="failed", stage=stage, line=str(e))
    except edgerev.EdgerevError as e:
        rec.update(outcome="refused", stage=stage, line=_first_line(e), error=type(e).__name__)
    except Exception as e:
        frames = traceback.format_exception(e)
        rec.update(outcome="crashed", stage=stage, line=f"{type(e).__name__}: {_first_line(e)}",
                   traceback="".join(frames[-6:]))
    return rec


def child(args) -> None:
    """One run in this process, under the CPU limit; its record on stdout's last line."""
    import torch

    resource.setrlimit(resource.RLIMIT_CPU, (args.cpu_limit, args.cpu_limit + 5))
    torch.set_num_threads(args.threads)
    opts = {"classes": args.classes, "batch": args.batch, "samples": args.samples, "epochs": args.epochs,
            "lr": args.lr, "fraction": args.fraction, "time": args.time}
    with tempfile.TemporaryDirectory() as tmp:
        rec = run(args.child_model, args.child_route, args.child_size, opts, Path(tmp))
    sys.stdout.write("\n" + json.dumps(rec) + "\n")


def one(args, name: str, route: str, size: int) -> dict:
    """:func:`run` in a child process: a crash, a hang or a blown CPU limit ends that run only."""
    cmd = [sys.executable, __file__, "--child-model", name, "--child-route", route, "--child-size", str(size),
           "--cpu-limit", str(args.cpu_limit), "--threads", str(args.threads), "--classes", str(args.classes),
           "--batch", str(args.batch), "--samples", str(args.samples), "--epochs", str(args.epochs),
           "--fraction", str(args.fraction), *(("--lr", str(args.lr)) if args.lr is not None else ()),
           *(("--time",) if args.time else ())]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = round(time.perf_counter() - start, 1)
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    try:
        rec = json.loads(last[0])
    except (IndexError, json.JSONDecodeError):
        cpu_out = proc.returncode in (-24, -9)  # SIGXCPU at the soft limit, SIGKILL at the hard one
        rec = {"model": name, "library": MODELS[name], "route": route, "size": size,
               "outcome": "timeout" if cpu_out else "crashed",
               "line": f"over the {args.cpu_limit} s CPU limit" if cpu_out else
               f"the child exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    rec["wall_seconds"] = seconds
    return rec


def summary(records: list[dict]) -> dict:
    counts = {k: sum(r["outcome"] == k for r in records) for k in OUTCOMES}
    table: dict = {}
    for r in records:
        table.setdefault(r["model"], {})[f"{r['route']}@{r['size']}"] = r["outcome"]
    planned = [r for r in records if "budget_bytes" in r]
    timed = {f"{r['model']}/{r['route']}@{r['size']}": r["step_time_ratio"] for r in records if "step_time_ratio" in r}
    return {"runs": len(records), "counts": counts,
            "fraction_ok": round(counts["ok"] / len(records), 3) if records else None, "target_fraction_ok": 0.9,
            "planned_at_fraction": f"{sum('fraction_refused' not in r for r in planned)} of {len(planned)}",
            "planned_at_fraction_training_all": f"{sum('fraction_refused_all' not in r for r in planned)} of "
                                                f"{len(planned)}",
            **({"step_time_ratios": timed, "target_step_time_ratio": 1.5} if timed else {}),
            "not_ok": [{k: r.get(k) for k in ("model", "route", "size", "outcome", "stage", "line")}
                       for r in records if r["outcome"] != "ok"],
            "table": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all)")
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated of {', '.join(ROUTES)}")
    ap.add_argument("--sizes", default="64", help="comma-separated input sizes (224 is heavy on two cores)")
    ap.add_argument("--cpu-limit", type=int, default=900, help="CPU seconds per run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (one child process each)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8, help="training images (as many are held out)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=None,
                    help="the learning rate (default: the recipe's for how the run starts, as a user gets it: 0.1 x "
                         "batch / 256 for a module from random weights, 0.01 for a file, its gradient clipped unit by "
                         "unit where its batch norms were folded)")
    ap.add_argument("--fraction", type=float, default=0.75, help="the planned budget, of the store-everything peak")
    ap.add_argument("--time", action="store_true",
                    help="time a step of the plan at --fraction against plain autograd's (the issue's 1.5x at half "
                         "the peak: --fraction 0.5)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child-model", help=argparse.SUPPRESS)
    ap.add_argument("--child-route", help=argparse.SUPPRESS)
    ap.add_argument("--child-size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_model:
        child(args)
        return
    models, routes = args.models.split(","), args.routes.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    unknown = [m for m in models if m not in MODELS] + [r for r in routes if r not in ROUTES]
    if unknown:
        ap.error(f"unknown models or routes: {', '.join(unknown)}")
    jobs = [(name, route, size) for size in sizes for name in models for route in routes]
    records: list[dict] = []
    result = {"benchmark": "zoo", "python": platform.python_version(), "settings": {
        k: getattr(args, k) for k in ("cpu_limit", "threads", "classes", "batch", "samples", "epochs", "lr", "fraction",
                                      "time")
    }, "runs": records}
    import onnxruntime
    import timm
    import torch
    import torchvision

    result["versions"] = {"torch": torch.__version__, "torchvision": torchvision.__version__, "timm": timm.__version__,
                          "onnxruntime": onnxruntime.__version__}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # each thread waits on its child process
        for rec in pool.map(lambda job: one(args, *job), jobs):
            records.append(rec)
            print(f"{rec['model']:24s} {rec['route']:7s} {rec['size']:4d} {rec['outcome']:8s} "
                  f"{rec.get('wall_seconds')}s {rec.get('line', '')[:200]}", file=sys.stderr, flush=True)
            result["summary"] = summary(records)
            if args.out:  # as it goes: a long sweep leaves what it has
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
