"""``edgerev doctor`` (thin: read the daemon's config or the CPU preset, call
:func:`edgerev.doctor.run_doctor`, print)."""

from __future__ import annotations

import argparse
import json

# configs/daemon/cpu.yaml's model, batch, optimizer, distillation, cap and free-space floor (tests/test_doctor.py
# checks they agree): what is checked without --config, with the current directory as the data directory
CPU_PRESET = {
    "data_dir": ".",
    "image_size": 32,
    "training": {"model": {"arch": "revnext", "args": {"width": 16, "blocks": [1, 1, 1, 1, 2]}},
                 "train": {"epochs": 30, "patience": 5, "batch": 64}, "optim": {"lr": 0.03},
                 "continual": {"replay": 2000, "distill": 1.0}, "memory": {"budget": "256MiB"}, "device": "cpu"},
    "storage": {"min_free_space": "100MiB"},
}
STATUS_MARK = {"ok": "ok     ", "warning": "WARNING", "failing": "FAILING"}


def _positive(flag: str, least: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{flag} must be at least {least}, got {value}")
        return value

    return parse


def target_of(config: str | None):
    """The :class:`~edgerev.doctor.Target` of a daemon config file, or of the CPU preset without one."""
    from dataclasses import replace

    from edgerev.doctor import Target
    from edgerev_daemon.config import config_from_dict, load_config
    from edgerev_daemon.learning.jobs import recipe

    if config is None:
        daemon = config_from_dict(CPU_PRESET)
        source = ("no --config: the CPU preset's model, batch and cap (configs/daemon/cpu.yaml), the current "
                  "directory as data directory")
    else:
        daemon = load_config(config)
        source = f"config {config}"
    t = daemon.training
    # the costliest job: every job after the first distills from the model in service
    cfg = replace(recipe(daemon, None), continual=t.continual)
    return Target(cfg, daemon.data_dir, daemon.storage.min_free_space, source)


def cmd_doctor(args: argparse.Namespace) -> int:
    from edgerev.doctor import exit_status, run_doctor, worst

    target = target_of(args.config)
    checks = run_doctor(target, steps=args.steps, classes=args.classes, profile=args.profile)
    status = exit_status(checks)
    if args.json:
        print(json.dumps({"source": target.source, "status": worst(checks).value, "exit_status": status,
                          "checks": [c.to_json() for c in checks]}, indent=2))
        return status
    print(f"edgerev doctor: {target.source}")
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{STATUS_MARK[c.status.value]} {c.name:<{width}}  {c.found}")
        if c.advice:
            print(f"{'':7} {'':<{width}}  -> {c.advice}")
    print(f"worst: {worst(checks).value} (exit status {status})")
    return status


def add_parser(sub) -> None:
    d = sub.add_parser("doctor", help="check this device for the daemon: Python, torch, GPU, ONNX Runtime, disk, "
                                      "and a verified plan under the cap",
                       description="One line per check, each ok, warning or failing with what to do: Python; torch "
                                   "and its CUDA; the GPU, its compute capability and whether this torch has kernels "
                                   "for it; its free and total memory against training.memory.budget; ONNX Runtime "
                                   "and its providers; Flower if installed; the data directory's free space (against "
                                   "storage.min_free_space) and write access; and the configured model planned "
                                   "under the configured cap, with a few real training steps whose measured peak is "
                                   "set against the cap (the costliest step: a job's that distills and, with FixMatch "
                                   "on, takes unlabelled images).",
                       epilog="exit status: 0 every line ok; 3 warnings only; 1 a failing line; 2 bad input (an "
                              "unreadable config)")
    d.add_argument("--config", help="the daemon's YAML config (default: the CPU preset's model and cap, "
                                    "configs/daemon/cpu.yaml, with the current directory as data directory)")
    d.add_argument("--steps", type=_positive("--steps"), default=2, metavar="N",
                   help="real training steps of the plan (default 2)")
    d.add_argument("--classes", type=_positive("--classes", least=2), default=10, metavar="K",
                   help="classes of the model's head (default 10)")
    d.add_argument("--profile", choices=("cached", "measure"), default="cached",
                   help="cached (default): the daemon's plan if its stage profile is cached, else the "
                        "least-memory modes at the largest micro-batch that fits; measure: measure the profile "
                        "first (minutes on a small CPU; cached for the daemon when run as its user with its "
                        "EDGEREV_CACHE)")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(fn=cmd_doctor)
