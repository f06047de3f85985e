"""A candidate's ONNX export in a process of its own, which a stop ends at once.

The export (``torch.onnx.export``, by default its dynamo exporter, then the check with ONNX Runtime) is one
call of several seconds that no stop flag can reach: 6-10 s for the CPU preset's model on one thread here,
more on a slower device, beyond the few seconds a SIGTERM may take. So it runs in a child process
(:mod:`edgerev_daemon.learning.children`), ``python -m edgerev_daemon.learning.exporting RUN_DIR OUT``.
Nothing is lost that matters when it is killed: the decision to promote is recorded before, the file is
written atomically, and the next start exports again. The price is the child's start: importing torch, ONNX
and ONNX Runtime, about 3 s per promotion here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from edgerev.errors import ExportError
from edgerev_daemon.learning import children

RESULT = "export.json"  # beside the ONNX file: the child's result
LOG = "export.log"  # the child's standard error, read back when it fails


def command(run_dir: Path, out: Path, threads: int | None, trust_factories: Sequence[str] = (),
            exporter: str = "auto") -> list[str]:
    """The child's command line."""
    cmd = [sys.executable, "-m", "edgerev_daemon.learning.exporting", str(run_dir), str(out), f"--exporter={exporter}"]
    cmd += [f"--trust-factory={f}" for f in trust_factories]
    return cmd + (["--threads", str(threads)] if threads else [])


def export(run_dir: Path, out: Path, stop: Callable[[], bool], threads: int | None = None,
           trust_factories: Sequence[str] = (), exporter: str = "auto") -> dict:
    """Export the model directory ``run_dir`` to ``out`` in a child process, verified with ONNX Runtime.

    ``trust_factories``: the factories ``run_dir`` may name (the daemon's ``training.model.factories``).
    ``exporter``: torch's exporter (``promotion.exporter``: auto, dynamo or legacy).

    Args:
        stop: asked while the child runs; True kills the child.
        threads: torch's CPU threads in the child (None: its default).

    Returns:
        The export's figures (difference to PyTorch, opset, IR, seconds, size, the exporter that wrote the file).

    Raises:
        Stopped: ``stop()`` said so before the export finished; no ``out`` was written.
        ExportError: the export or its verification failed (the child's last lines of error output).
    """
    result, log = out.parent / RESULT, out.parent / LOG
    result.unlink(missing_ok=True)
    code = children.run(command(run_dir, out, threads, trust_factories, exporter), log, stop, "the ONNX export")
    if code != 0 or not result.is_file():
        raise ExportError(f"the ONNX export failed (exit status {code}): {children.tail(log)}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgerev_daemon.learning.exporting", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--threads", type=int)
    p.add_argument("--exporter", default="auto")
    p.add_argument("--trust-factory", action="append", default=[])
    args = p.parse_args(argv)
    children.end_with_parent()
    import torch

    from edgerev.atomic import atomic_write
    from edgerev.export.onnx import export_onnx

    if args.threads:
        torch.set_num_threads(args.threads)
    r = export_onnx(args.run_dir, args.out, trust_factories=args.trust_factory, exporter=args.exporter)
    figures = {"max_abs_diff": r.max_abs_diff, "opset": r.opset, "ir_version": r.ir_version,
               "export_seconds": round(r.seconds, 3), "size_bytes": r.size_bytes, "exporter": r.exporter}
    atomic_write(args.out.parent / RESULT, (json.dumps(figures) + "\n").encode())
    return 0


if __name__ == "__main__":
    children.run_main(main, ExportError)
