"""Command line: parse, validate, call one library function, print (JSON with ``--json``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

# Before torch (and its OpenMP runtime) is imported: threads waiting for work sleep instead of spinning,
# so training does not take cores from the device's other work (the systemd unit sets the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from edgerev import __version__  # noqa: E402
from edgerev.errors import EdgerevError, one_line  # noqa: E402
from edgerev.exits import EPILOG  # noqa: E402
from edgerev.exits import PARTIAL as EXIT_PARTIAL  # noqa: E402
from edgerev.exits import PIPE as EXIT_PIPE  # noqa: E402
from edgerev.exits import USAGE as EXIT_USAGE  # noqa: E402

# RevNeXt paper (Hascoet et al. 2023), batch 32 at 240x240: peak training memory per architecture
PAPER_PEAK_BYTES = {
    "resnet18": 3.81e9,
    "revnet": 1.19e9,
    "irevnet": 1.35e9,
    "layerwise": 590e6,
    "revnext": 648e6,
}
PAPER_PIXELS = 32 * 240 * 240
SOURCES = ("a registry name, a model directory (a path with a /), an .onnx file, or a factory "
           "package.module:callable")
COMMANDS = "edgerev.cli"  # the entry-point group of functions that add commands: add(subparsers)
MODE_HELP = ("engine mode for every stage that supports it (invert, floor, recompute, store, store8, store4), "
             "or one per stage, comma-separated (default: each stage's default, invert where supported)")


def _positive(kind: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be a whole number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{kind} must be positive, got {value}")
        return value

    return parse


def _device(name: str) -> str:
    if name not in ("cpu", "cuda"):
        raise EdgerevError(f"unknown device {name!r}; choose cpu or cuda")
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EdgerevError("--device cuda asked for, but this machine has no usable CUDA device")
    return name


def _source(name: str) -> str:
    """A model source (:mod:`edgerev.models.resolve`), checked by its spelling before anything runs."""
    from edgerev.models.names import source_kind

    source_kind(name)
    return name


def _arch(name: str) -> str:
    from edgerev.models import list_models

    if name not in list_models():
        raise EdgerevError(f"unknown architecture {name!r}; choose from {', '.join(list_models())}")
    return name


def _per_px(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def cmd_memory(args: argparse.Namespace) -> int:
    from edgerev.layers import chunk_budget
    from edgerev.memory.measure.peak import measure

    device = _device(args.device)
    if args.table == bool(args.arch):
        raise EdgerevError("give either --arch NAME or --table")
    archs = list(PAPER_PEAK_BYTES) if args.table else [_source(args.arch)]
    rows = []
    with chunk_budget(args.chunk_bytes):
        for arch in archs:
            row = measure(arch, batch=args.batch, size=args.size, device=device, fake=args.fake, modes=args.mode,
                          trust_factories=args.trust_factory)
            row["chunk_bytes"] = args.chunk_bytes
            paper = PAPER_PEAK_BYTES.get(arch)
            if paper is not None:
                row["paper_peak_bytes"] = paper
                row["paper_bytes_per_pixel"] = paper / PAPER_PIXELS
            rows.append(row)
            if not args.json and args.table:
                print(f"measured {arch}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows if args.table else rows[0], indent=2))
        return 0
    how = "predicted with fake tensors" if args.fake else f"measured on {device}"
    print(f"training-step memory, batch {args.batch} at {args.size}x{args.size}, float32 ({how})")
    head = f"{'arch':<10} {'params':>10} {'peak':>10} {'B/px':>7} {'model':>7} {'paper':>9} {'paper/px':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        paper = _mb(r["paper_peak_bytes"]) if "paper_peak_bytes" in r else "-"
        ppx = f"{r['paper_bytes_per_pixel']:.0f}" if "paper_bytes_per_pixel" in r else "-"
        print(f"{r['arch']:<10} {r['params']:>10,} {_mb(r['peak_bytes']):>10} {r['bytes_per_pixel']:>7.0f} "
              f"{_per_px(r['model_bytes_per_pixel']):>7} {paper:>9} {ppx:>9}")
    print("B/px: slope of the peak between batch B and 2B per input pixel; model: analytic;\n"
          "paper: its peak at batch 32, 240x240, and that peak over its pixels (the paper gives no slope)")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from edgerev.diagnostics import diagnose

    result = diagnose(_arch(args.arch), depth=args.depth, batch=args.batch, size=args.size, seed=args.seed,
                      modes=args.mode)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0

    def fmt(v: float | None) -> str:
        return "exact" if v is None else f"{v:.1f}"

    print(f"{result['arch']}: {result['invertible_stages']} invertible stages, batch {args.batch}, "
          f"{args.size}x{args.size}, float32")
    print(f"{'#':>3} {'stage':<16} {'mode':<10} {'SNR dB':>8} {'grad angle':>11}")
    for s in result["stages"]:
        angle = f"{s['grad_angle_deg']:.2e}" if "grad_angle_deg" in s else "-"
        print(f"{s['index']:>3} {s['type']:<16} {s['mode']:<10} {fmt(s['snr_db']):>8} {angle:>11}")
    print(f"min reconstruction SNR {fmt(result['min_snr_db'])} dB; max gradient angle "
          f"{result['max_grad_angle_deg']:.2e} deg; min cosine {result['min_param_cosine']:.8f}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from edgerev.api import plan

    device = _device(args.device)
    p = plan(_source(args.arch), size=args.size, budget=args.budget, batch=args.batch, device=device,
             momentum=args.momentum, estimate=args.estimate, verify=args.verify, weights=args.weights,
             trust_factories=args.trust_factory, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result, budget = p.summary, p.summary["budget_bytes"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.arch} at {args.size}x{args.size} on {device}, budget {budget:,} bytes, {result['planner']}")
    steps = f"step of {args.batch} samples in micro-batches of {p.batch}" if args.batch else f"batch {p.batch}"
    print(f"{steps}, predicted peak "
          f"{result['predicted_peak_bytes']:,} bytes, {result['samples_per_second'] or 0:.1f} samples/s predicted")
    if p.account is not None:
        a = p.account
        print(f"  held: weights {a.weights:,}, buffers {a.buffers:,}, optimizer {a.optimizer:,}, batch "
              f"{a.batch_input + a.labels:,}; the step: {a.step_bytes:,} (gradients {a.gradients:,} and activations)")
    if args.verify:
        print(f"measured peak {result['measured_peak_bytes']:,} bytes, "
              f"{result['measured_samples_per_second']:.1f} samples/s measured")
    print(f"{'#':>3} {'stage':<16} mode")
    for i, st in enumerate(result["stages"]):
        print(f"{i:>3} {st['type']:<16} {st['mode']}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import signal

    from edgerev.api import fit_run
    from edgerev.train.config import load_config

    if args.config is None and not args.resume and args.arch is None:
        raise EdgerevError("give --config FILE.yaml or --arch (or --resume to continue the run in --out)")
    cfg = load_config(args.config) if args.config is not None else None
    stop = {"asked": False}

    def ask_stop(signum, frame):  # finish the step, checkpoint, return
        stop["asked"] = True

    old = {s: signal.signal(s, ask_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = fit_run(_source(args.arch) if args.arch else None, out=args.out, config=cfg, resume=args.resume,
                         weights=args.weights, stop=lambda: stop["asked"], progress=False if args.quiet else None,
                         trust_factories=args.trust_factory)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    report = {"status": result.status, "out": str(result.out), "step": result.step, "total_steps": result.total_steps,
              **result.summary}
    if args.json:
        print(json.dumps(report, indent=2))
    elif result.status == "stopped":
        print(f"stopped at step {result.step} of {result.total_steps}, checkpoint in {result.out}; "
              f"continue with: edgerev train --out {result.out} --resume")
    else:
        final = result.summary["final"]
        line = f"done: {result.step} steps, validation accuracy {final['acc']:.4f}"
        if final.get("old_acc") is not None:
            line += f" (old classes {final['old_acc']:.4f}, new classes {final['new_acc']:.4f}"
            if "forgetting" in result.summary:
                line += f", forgetting {result.summary['forgetting']:+.4f}"
            line += ")"
        print(line)
        print(f"model directory: {result.out} (model.safetensors, model.json, curves.png, metrics.jsonl)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from edgerev.export.onnx import export_onnx

    r = export_onnx(args.run, args.out, batch=args.batch, tolerance=args.tolerance, exporter=args.exporter,
                    trust_factories=args.trust_factory)
    if args.json:
        print(json.dumps(r.to_json(), indent=2))
        return 0
    print(f"wrote {r.path}: {r.size_bytes:,} bytes, opset {r.opset}, IR {r.ir_version}, dynamic batch, "
          f"{r.exporter} exporter")
    print(f"ONNX Runtime against PyTorch: max abs difference of logits {r.max_abs_diff:.2e} "
          f"(batches {', '.join(map(str, r.batches))}; tolerance {args.tolerance:g})")
    print(f"export {r.seconds:.1f} s, verification {r.verify_seconds:.1f} s")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from edgerev.export.predict import Predictor  # ONNX Runtime, Pillow and numpy: no torch on this path

    predictions = Predictor(args.model).predict(args.images, top=args.top)
    failed = [p for p in predictions if p.error is not None]
    for p in failed:
        print(f"edgerev predict: error: {p.error}", file=sys.stderr)
    if args.json:
        print(json.dumps([p.to_json() for p in predictions], indent=2))
    else:
        for p in predictions:
            if p.error is None:
                others = ", ".join(f"{c} {q:.4f}" for c, q in p.top[1:])
                print(f"{p.source}: {p.label} {p.probability:.4f}" + (f"  ({others})" if others else ""))
    return EXIT_PARTIAL if failed else 0


def cmd_finetune_head(args: argparse.Namespace) -> int:
    from edgerev.export.finetune import finetune_head  # ONNX Runtime and numpy: no torch

    r = finetune_head(args.model, args.data, args.out, val=args.val, epochs=args.epochs, lr=args.lr,
                      batch=args.batch, optimizer=args.optimizer, seed=args.seed, backend=args.backend)
    if args.json:
        print(json.dumps(r.to_json(), indent=2))
        return 0
    print(f"trained the head ({r.backend}) on {r.samples} images ({len(r.skipped)} unreadable skipped), {r.epochs} "
          f"epochs of {r.optimizer} at lr {r.lr:g}: loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}")
    print(f"training accuracy {r.train_accuracy_before:.4f} -> {r.train_accuracy_after:.4f}")
    if r.val_accuracy_before is not None:
        print(f"validation accuracy {r.val_accuracy_before:.4f} -> {r.val_accuracy_after:.4f} ({r.val_samples} images)")
    print(f"wrote {r.path} in {r.seconds:.1f} s")
    return 0


def registered_commands() -> list[Callable[..., None]]:
    """The functions that add other packages' commands (the service's ``doctor``, ``daemon`` and ``fleet``), in
    the order of their entry points' names: registered in the ``edgerev.cli`` entry-point group, so that the library
    never imports the service; from a source tree never installed, as its pyproject.toml registers them
    (:mod:`edgerev.source_tree`)."""
    from importlib.metadata import entry_points

    from edgerev.source_tree import declared_entry_points, map_package_dirs

    map_package_dirs()  # a source tree's daemon/ under its installed name, unless installed
    found = list(entry_points(group=COMMANDS)) or declared_entry_points(COMMANDS)
    return [ep.load() for ep in sorted(found, key=lambda ep: ep.name)]


def _trust_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-factory", action="append", default=[], metavar="PACKAGE.MODULE:CALLABLE",
                   help="a factory a model directory may name (repeatable): a model directory is data and runs no "
                        "code unless you allow its factory here; naming one trusts its module's code")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgerev",
                                description="On-device continual learning: reversible networks trained under a hard "
                                            "memory cap, ONNX export, and the service that keeps a model up to date.",
                                epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"edgerev {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("memory", help="peak memory of one training step, measured or predicted",
                       description="Peak live bytes of one training step (forward, loss, backward) and bytes per "
                                   "input pixel: the slope of the peak between batch B and 2B.")
    m.add_argument("--arch", help="the model: " + SOURCES)
    m.add_argument("--table", action="store_true", help="all five architectures beside the paper's figures")
    m.add_argument("--batch", type=_positive("--batch"), default=32, help="batch size B (default 32)")
    m.add_argument("--size", type=_positive("--size"), default=240, help="input height and width (default 240)")
    m.add_argument("--device", default="cpu", help="cpu (live-tensor tracker) or cuda (allocator peak)")
    m.add_argument("--fake", action="store_true", help="predict with fake tensors: nothing is allocated")
    m.add_argument("--chunk-bytes", type=int, default=1 << 20,
                   help="batch-slice budget of the engine's temporaries in bytes (default 1 MiB; 0: never slice)")
    m.add_argument("--mode", help=MODE_HELP)
    m.add_argument("--json", action="store_true", help="print JSON")
    _trust_argument(m)
    m.set_defaults(fn=cmd_memory)

    pl = sub.add_parser("plan", help="batch size and per-stage modes that train fastest under a byte budget",
                        description="Choose a micro-batch and a mode per stage (invert, floor, recompute, store, "
                                    "store8, store4; checkpoint segments for a plain model) that maximize samples per "
                                    "second while the peak of the whole training step, as the trainer counts it, "
                                    "stays under the budget. A budget below the smallest step is refused at once, "
                                    "naming it. Stage costs are measured once per model, size and device and "
                                    "cached. When planning takes more than a few seconds, each phase is named on "
                                    "stderr as it begins.")
    pl.add_argument("--arch", required=True, help="the model: " + SOURCES)
    pl.add_argument("--weights", help="pretrained weights of a registry model or factory: safetensors or a state_dict")
    _trust_argument(pl)
    pl.add_argument("--size", type=_positive("--size"), required=True, help="input height and width")
    pl.add_argument("--budget", required=True, help="bytes, e.g. 400MiB, 1.5GB or 1000000: the whole step, as the "
                    "trainer counts it (weights, gradients, momentum, the batch, activations)")
    pl.add_argument("--batch", type=_positive("--batch"), default=None,
                    help="samples per optimizer step, split into micro-batches as the budget needs, as a recipe's "
                         "train.batch (default: no accumulation, the planner picks the batch)")
    pl.add_argument("--no-momentum", dest="momentum", action="store_false",
                    help="an optimizer without momentum state (the recipe's SGD keeps one buffer per weight)")
    pl.add_argument("--device", default="cpu", help="cpu or cuda")
    pl.add_argument("--verify", action="store_true", help="run real training steps with the plan and measure them")
    pl.add_argument("--estimate", action="store_true",
                    help="estimate costs (fake tensors: FLOPs and kernel launches) instead of measuring")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(fn=cmd_plan)

    d = sub.add_parser("diagnose", help="reconstruction SNR and gradient angles of the memory-saving backward",
                       description="One float32 training step through the engine and through plain autograd: "
                                   "per-stage and per-layer reconstruction SNR, per-stage gradient angle.")
    d.add_argument("--arch", required=True, help="registry name")
    d.add_argument("--depth", type=_positive("--depth"), help="blocks (or layer triples) per level")
    d.add_argument("--batch", type=_positive("--batch"), default=8, help="batch size (default 8)")
    d.add_argument("--size", type=_positive("--size"), default=32, help="input size (default 32)")
    d.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    d.add_argument("--mode", help=MODE_HELP)
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(fn=cmd_diagnose)

    t = sub.add_parser("train", help="train or fine-tune a model from a YAML recipe",
                       description="Train (or fine-tune from model.init, growing the head for new classes) as the "
                                   "recipe says, under its memory budget, stopping on a held-out plateau (after "
                                   "train.anneal_epochs of falling learning rate) when train.patience is set. Writes "
                                   "the resolved config, metrics.jsonl, progress.json, "
                                   "checkpoints, curves.png, classes.png and a model directory (model.safetensors + "
                                   "model.json) to --out. Progress goes to stderr: a bar on a terminal, otherwise one "
                                   "line per epoch and every train.progress_seconds. SIGTERM or Ctrl-C stops at a "
                                   "step boundary with a checkpoint.")
    t.add_argument("--config", help="the recipe (YAML); see configs/")
    t.add_argument("--arch", help="the model, in place of the recipe's model.arch: " + SOURCES)
    t.add_argument("--weights", help="pretrained weights of a registry model or factory (the recipe's model.weights)")
    t.add_argument("--out", required=True, help="output folder of the run")
    _trust_argument(t)
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    t.add_argument("--quiet", action="store_true", help="no progress bar and no progress lines")
    t.add_argument("--json", action="store_true", help="print the run's summary as JSON")
    t.set_defaults(fn=cmd_train)

    for add_commands in registered_commands():  # the service's: doctor, daemon, fleet
        add_commands(sub)

    e = sub.add_parser("export", help="export a model directory to ONNX, verified with ONNX Runtime",
                       description="Export the model directory RUN (model.json + model.safetensors) to ONNX with a "
                                   "dynamic batch (opset <= 21, IR <= 10), check its logits against PyTorch with "
                                   "ONNX Runtime, and write it only if they agree. Classes, input size and "
                                   "normalization go into the file's metadata.")
    e.add_argument("--run", required=True, help="model directory (a training run's output)")
    e.add_argument("--out", required=True, help="the .onnx file to write")
    e.add_argument("--batch", type=_positive("--batch"), default=4, help="verification batch size (default 4)")
    e.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest accepted difference of logits, relative to the largest logit above 1 (default 1e-4)")
    e.add_argument("--exporter", choices=("auto", "dynamo", "legacy"), default="auto",
                   help="torch.export-based (dynamo), the deprecated TorchScript exporter (legacy), or auto (default): "
                        "dynamo, and legacy where dynamo fails (torch 2.6); either file is verified the same way")
    _trust_argument(e)
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(fn=cmd_export)

    pr = sub.add_parser("predict", help="classify images with an exported model (ONNX Runtime, no PyTorch)",
                        description="Decode, resize and normalize each image as the model's metadata says, run it "
                                    "with ONNX Runtime and print the most probable class and its probability. A "
                                    "file that is missing or not an image is reported on stderr, the rest are "
                                    "classified, and the exit status is 1.")
    pr.add_argument("--model", required=True, help="an .onnx file written by 'edgerev export'")
    pr.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, anything Pillow reads)")
    pr.add_argument("--top", type=_positive("--top"), default=1, help="classes to list per image (default 1)")
    pr.add_argument("--json", action="store_true", help="print JSON")
    pr.set_defaults(fn=cmd_predict)

    f = sub.add_parser("finetune-head", help="train an exported model's head on its frozen backbone (no PyTorch)",
                       description="Fine-tune the final linear layer of an exported model on a frozen backbone, on a "
                                   "folder of <class>/<image> files whose class names are among the model's, and "
                                   "write a new .onnx with the trained head. The backbone runs with ONNX Runtime; "
                                   "the head trains in numpy (default) or with ONNX Runtime training "
                                   "(--backend onnxruntime, pip install 'edgerev[ort-training]', Python <= 3.11).")
    f.add_argument("--model", required=True, help="an .onnx file written by 'edgerev export'")
    f.add_argument("--data", required=True, help="training images: FOLDER/<class>/<image>")
    f.add_argument("--out", required=True, help="the .onnx file to write")
    f.add_argument("--val", help="held-out images, same layout: accuracy before and after")
    f.add_argument("--epochs", type=_positive("--epochs"), default=10, help="passes over the data (default 10)")
    f.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 0.01)")
    f.add_argument("--batch", type=_positive("--batch"), default=32, help="mini-batch size (default 32)")
    f.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="optimizer (default adamw)")
    f.add_argument("--seed", type=int, default=0, help="shuffling seed (default 0)")
    f.add_argument("--backend", choices=("numpy", "onnxruntime"), default="numpy",
                   help="numpy (default; needs only ONNX Runtime inference) or onnxruntime (ONNX Runtime training)")
    f.add_argument("--json", action="store_true", help="print JSON")
    f.set_defaults(fn=cmd_finetune_head)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        try:
            status = args.fn(args)
        except ValueError as e:  # EdgerevError, and bad values the model constructors refuse
            command = " ".join(c for c in (args.command, getattr(args, "daemon_command", None),
                                           getattr(args, "fleet_command", None)) if c)
            print(f"edgerev {command}: error: {one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return status
    except BrokenPipeError:
        # the reader left (`edgerev daemon status --json | head`): no traceback, and no second error when
        # the interpreter flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
