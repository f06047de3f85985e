"""A candidate's ONNX export in a process of its own, which a stop ends at once.

The export (``torch.onnx.export``'s dynamo exporter, then the check with ONNX Runtime) is one call of
several seconds that no stop flag can reach: 6-10 s for the CPU preset's model on one thread, more on a
slower device, beyond the few seconds a SIGTERM may take. So the daemon runs it in a child process
(``python -m edgerev_daemon.exporting``) and waits on it, asking its stop flag meanwhile; a stop kills the
child and raises :class:`~edgerev_daemon.errors.Stopped`. Nothing of the export is lost that matters:
the file is written atomically by the child (a killed child leaves no ``model.onnx``), the decision to
promote is recorded before, and the next start exports again.

The price is the child's start: importing torch, ONNX and ONNX Runtime, about 3 s on this machine per
promotion (the child is spawned, not forked: a fork of a process whose OpenMP pool and other threads
have run is not safe). The child also ends by itself when the daemon dies (kill -9, power aside): it
reads its standard input, which reaches its end when the parent's side closes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from edgerev.errors import ExportError
from edgerev_daemon.errors import Stopped

RESULT = "export.json"  # beside the ONNX file: the child's result
LOG = "export.log"  # the child's standard error, read back when it fails
POLL_SECONDS = 0.2  # how often the wait asks the stop flag (and pings the watchdog through it)


def command(run_dir: Path, out: Path, threads: int | None) -> list[str]:
    """The child's command line."""
    cmd = [sys.executable, "-m", "edgerev_daemon.exporting", str(run_dir), str(out)]
    return cmd + (["--threads", str(threads)] if threads else [])


def export(run_dir: Path, out: Path, stop: Callable[[], bool], threads: int | None = None) -> dict:
    """Export the model directory ``run_dir`` to ``out`` in a child process, verified with ONNX Runtime.

    Args:
        stop: asked every :data:`POLL_SECONDS` while the child runs; True kills the child.
        threads: torch's CPU threads in the child (None: its default).

    Returns:
        The export's figures (difference to PyTorch, opset, IR, seconds, size).

    Raises:
        Stopped: ``stop()`` said so before the export finished; no ``out`` was written.
        ExportError: the export or its verification failed (the child's last lines of error output).
    """
    if stop():
        raise Stopped("the ONNX export")
    result, log_path = out.parent / RESULT, out.parent / LOG
    result.unlink(missing_ok=True)
    with open(log_path, "wb") as err:
        child = subprocess.Popen(command(run_dir, out, threads), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=err)
    try:
        while True:
            try:
                code = child.wait(POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if stop():
                    raise Stopped("the ONNX export") from None
    finally:
        if child.poll() is None:  # stopped (or anything else raised here): the child goes with it
            child.kill()
            child.wait()
        child.stdin.close()
    if code != 0 or not result.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise ExportError(f"the ONNX export failed (exit status {code}): " + " | ".join(tail))
    return json.loads(result.read_text())


def _orphaned() -> None:
    """End the process when the parent's end of standard input closes (the daemon died)."""
    sys.stdin.buffer.read()
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgerev_daemon.exporting", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    threading.Thread(target=_orphaned, daemon=True).start()
    import torch

    from edgerev.atomic import atomic_write
    from edgerev.export.onnx import export_onnx

    if args.threads:
        torch.set_num_threads(args.threads)
    r = export_onnx(args.run_dir, args.out)
    figures = {"max_abs_diff": r.max_abs_diff, "opset": r.opset, "ir_version": r.ir_version,
               "export_seconds": round(r.seconds, 3), "size_bytes": r.size_bytes}
    atomic_write(args.out.parent / RESULT, (json.dumps(figures) + "\n").encode())
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except ExportError as e:
        print(f"edgerev: {e}", file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # not sys.exit: the thread blocked on standard input cannot be joined at shutdown
