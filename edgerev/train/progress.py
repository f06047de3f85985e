"""What a run says while it trains, and when it stops on a plateau.

- :class:`Progress`: one report (step, epoch, loss, learning rate, speed, ETA, the last held-out
  figures), as a line for people (:meth:`Progress.line`) and as JSON for programs.
- ``progress.json`` beside the run: the latest report, replaced atomically at every report, so that a
  status command in another process reads the running job's step, epoch, loss and ETA without torch
  (:func:`read_progress`).
- :class:`Pacer`: reports at every epoch's end and, within long epochs, every ``train.progress_seconds``
  of an injected clock.
- :class:`Plateau`: early stopping. An epoch improves when its held-out accuracy beats the best so far
  (a tie counts when its held-out loss is lower); after ``train.patience`` epochs without one, patience
  has run out (:attr:`Plateau.ran_out`) and the run anneals, then stops (:mod:`edgerev.train.schedule`).
  Its state is a function of the run's eval rows, so a resumed run decides as an uninterrupted one.

No torch import: ``status`` and the HTTP page read progress files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

PROGRESS = "progress.json"


def duration(seconds: float) -> str:
    """``2h05m``, ``3m07s``, ``12s``: a short human duration."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s" if m else f"{s}s"


@dataclass(frozen=True)
class Progress:
    """One report of a running (or just ended) training run.

    ``state``: ``running``; at the end ``done``, ``stopped`` (a stop was asked, checkpointed) or
    ``plateau`` (early stopping). ``eta_seconds`` runs to ``total_steps``: the epoch maximum (with early
    stopping an upper bound), and once patience has run out the end of the anneal that follows.
    ``val_acc``/``val_loss`` are the last epoch's held-out figures (None before the first epoch ends);
    ``best_acc`` at ``best_epoch`` the best of them so far.
    """

    state: str
    step: int
    total_steps: int
    epoch: int  # 1-based: the epoch the step belongs to
    epochs: int
    loss: float | None  # mean training loss since the previous report
    lr: float
    steps_per_second: float | None
    eta_seconds: float | None
    val_acc: float | None = None
    val_loss: float | None = None
    best_acc: float | None = None
    best_epoch: int | None = None
    at: float = 0.0  # wall-clock time of the report (seconds since the epoch)
    unlabeled: int | None = None  # FixMatch: unlabelled images this epoch's steps took so far (None: none given)
    pseudo_labeled: int | None = None  # of them, those that got a pseudo-label

    def line(self) -> str:
        """One line, e.g. ``epoch 3/20 step 150/1000 loss 0.8120 lr 0.21 | val acc 71.2% loss 0.9300
        (best 72.0% at epoch 2) | 4.10 steps/s ETA 3m27s`` (the last part is the state once it ends)."""
        parts = [f"epoch {self.epoch}/{self.epochs} step {self.step}/{self.total_steps}"]
        if self.loss is not None:
            parts[0] += f" loss {self.loss:.4f}"
        parts[0] += f" lr {self.lr:.3g}"
        if self.val_acc is not None:
            val = f"val acc {100 * self.val_acc:.1f}%"
            if self.val_loss is not None:
                val += f" loss {self.val_loss:.4f}"
            if self.best_acc is not None and self.best_epoch is not None:
                val += f" (best {100 * self.best_acc:.1f}% at epoch {self.best_epoch})"
            parts.append(val)
        if self.unlabeled is not None:
            parts.append(f"pseudo-labelled {self.pseudo_labeled}/{self.unlabeled} unlabelled")
        if self.state == "running":
            speed = f"{self.steps_per_second:.2f} steps/s" if self.steps_per_second else "speed unknown"
            if self.eta_seconds is not None:
                speed += f" ETA {duration(self.eta_seconds)}"
            parts.append(speed)
        else:
            parts.append(self.state)
        return " | ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)


def write_progress(run_dir: Path, progress: Progress) -> None:
    """Replace ``run_dir/progress.json`` (rename over the old one; no fsync: it is a report, not data).

    A file system that refuses the write (full, read-only) costs the report, never the run.
    """
    path = Path(run_dir) / PROGRESS
    tmp = path.with_name(f".{PROGRESS}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(progress.to_json()))
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def read_progress(run_dir: str | Path) -> dict | None:
    """The latest report of the run in ``run_dir`` as JSON, or None (none yet, or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Pacer:
    """Says when to report: at each epoch's end, and every ``seconds`` of ``clock`` within an epoch."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self._last = clock()

    def due(self, end_of_epoch: bool) -> bool:
        now = self.clock()
        if end_of_epoch or now - self._last >= self.seconds:
            self._last = now
            return True
        return False


class Plateau:
    """Early stopping on the held-out figures of each epoch (see the module docstring).

    Args:
        patience: epochs without improvement before :attr:`stop` turns True (None: never).
        rows: the eval rows a resumed run already logged (``{"epoch", "acc", "loss"}``).
    """

    def __init__(self, patience: int | None, rows: Iterable[dict] = ()) -> None:
        self.patience = patience
        self.best_acc: float | None = None
        self.best_loss: float | None = None
        self.best_epoch: int | None = None
        self.last_epoch = 0
        self.ran_out: int | None = None  # the first epoch at whose end patience had run out; it stays
        self._why: str | None = None  # the reason, said when it ran out (the tail's epochs may still improve)
        for row in rows:
            self.update(row["epoch"], row.get("acc"), row.get("loss"))

    def update(self, epoch: int, acc: float | None, loss: float | None) -> bool:
        """Record epoch ``epoch``'s held-out figures; True when it is the best so far."""
        self.last_epoch = epoch
        better = acc is not None and (
            self.best_acc is None or acc > self.best_acc
            or (acc == self.best_acc and loss is not None and (self.best_loss is None or loss < self.best_loss)))
        if better:
            self.best_acc, self.best_loss, self.best_epoch = acc, loss, epoch
        if self.ran_out is None and self.stop:
            self.ran_out = epoch
            self._why = (f"no held-out gain for {epoch - self.best_epoch} epochs (patience {self.patience}): "
                         f"best accuracy {self.best_acc:.4f} at epoch {self.best_epoch}")
        return better

    @property
    def stop(self) -> bool:
        """``patience`` epochs have passed since the best one (now: a later best clears it)."""
        if self.patience is None or self.best_epoch is None:
            return False
        return self.last_epoch - self.best_epoch >= self.patience

    def reason(self) -> str | None:
        """Why patience ran out, as it stood then (None before)."""
        return self._why
