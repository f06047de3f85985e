"""A model's stage profile, measured in a process of its own before the first job that needs it.

The planner of a job under ``training.memory.budget`` needs the model's stage profile: what each stage
keeps and costs in each mode, measured on this machine (or estimated) the first time and cached
(:func:`edgerev.memory.measure.profile.load_or_measure`). The measurement runs every stage in every exact mode (the
planner's first question; the approximate modes are measured by a job's plan only where no exact plan fits): minutes
on a small CPU, and nothing in it asks
a stop flag. So the daemon measures it in a child process (:mod:`edgerev_daemon.learning.children`) that a stop
kills, before the job's training, whenever the cache lacks it; the trainer's plan then finds it cached. The
child names each stage as it begins, and the daemon logs those lines as they come: a long wait is not a silent one.
A killed measurement writes nothing (the cache file is renamed into place) and runs again at the next job.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from edgerev.errors import EdgerevError
from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.learning import children

LOG = "profile.log"
PROGRESS = "progress: "  # the child's lines that the daemon logs (the rest, an error's traceback, stays in LOG)
log = logging.getLogger("edgerev.daemon.profiling")


def _target(config: DaemonConfig):
    """(model, device type, estimate) the trainer's plan will look up, or None when it plans no stage modes."""
    t = config.training
    if t.memory.budget is None or t.memory.mode == "plain":
        return None
    import torch

    from edgerev.models.resolve import resolve_model

    model = resolve_model(t.model.arch, weights=t.model.weights, args=t.model.args, num_classes=2,
                          trust_factories=t.model.factories)
    if model.engine is None:  # a model from outside: checkpoint segments, no stage profile
        return None
    device = "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
    return model.module, device, t.memory.profile == "estimate"


def ensure_profile(config: DaemonConfig, folder: Path, stop: Callable[[], bool]) -> bool:
    """Measure the configured model's stage profile in a child process if the cache lacks it.

    Args:
        folder: where the child's error output goes (the job's folder).

    Returns:
        True when it was measured now.

    Raises:
        Stopped: ``stop()`` said so before the measurement ended.
        EdgerevError: the measurement failed (the child's last lines of error output).
    """
    from edgerev.memory.measure.profile import cached_profile

    target = _target(config)
    if target is None:
        return False
    model, device, estimate = target
    if cached_profile(model, config.image_size, device, estimate=estimate, exact=True) is not None:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    t = config.training
    spec = {"arch": t.model.arch, "weights": t.model.weights, "args": dict(t.model.args), "size": config.image_size,
            "device": device, "estimate": estimate, "threads": t.train.threads,
            "trust_factories": list(t.model.factories)}
    out = folder / LOG
    log.info("measuring the stage profile of %s on the %s (%s) before the job trains: once per model, size and "
             "machine, cached for later jobs; on a small CPU it takes a while, each stage is logged as it begins",
             t.model.arch, device, "estimated" if estimate else "measured")
    code = children.run(command(spec), out, stop, "the stage profile's measurement", lines=_progress)
    if code != 0:
        raise EdgerevError(f"the stage profile's measurement failed (exit status {code}): {children.tail(out)}")
    return True


def _progress(line: str) -> None:
    """Log a line of the child's progress (its other lines, an error's traceback, stay in its log file)."""
    if line.startswith(PROGRESS):
        log.info("stage profile: %s", line[len(PROGRESS):])


def command(spec: dict) -> list[str]:
    """The child's command line: what to measure, as JSON."""
    return [sys.executable, "-m", "edgerev_daemon.learning.profiling", json.dumps(spec)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgerev_daemon.learning.profiling", description=__doc__.splitlines()[0])
    p.add_argument("spec", help="JSON: arch, weights, args, size, device, estimate, threads, trust_factories")
    spec = json.loads(p.parse_args(argv).spec)
    children.end_with_parent()
    import torch

    from edgerev.memory.measure.profile import load_or_measure
    from edgerev.models.resolve import resolve_model
    from edgerev.train.config import default_threads

    torch.set_num_threads(spec.get("threads") or default_threads())  # the trainer's: the profile times steps
    model = resolve_model(spec["arch"], weights=spec["weights"], args=spec["args"], num_classes=2,
                          trust_factories=spec.get("trust_factories", ())).module  # the daemon's config's, handed down
    verb = "estimating" if spec["estimate"] else "measuring"
    load_or_measure(model, spec["size"], spec["device"], estimate=spec["estimate"], exact=True,
                    progress=lambda i, n: print(f"{PROGRESS}{verb} stage {i + 1}/{n}", file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    children.run_main(main, EdgerevError)
