"""Progress of a plan that takes a while: one line per phase, once planning has run longer than a threshold.

Most plans answer in a second or two and say nothing on the way. A first plan of a large model profiles every
stage, and a measured profile runs real steps: tens of seconds on a small CPU, which a user at a terminal or a
daemon's log would otherwise see as silence. So the planner names each phase as it starts (:meth:`Progress.phase`)
and each stage a profile measures (:meth:`Progress.step`); from the moment planning has taken ``after`` seconds,
those names are passed on to the sink (the CLI writes them to stderr, the daemon logs them), each with the seconds
since planning began. The clock is injected, so tests drive it instead of waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: seconds of planning before phases are reported: a plan that answers sooner says nothing
REPORT_AFTER = 2.0


class Progress:
    """Where planning is, passed to ``sink`` as one line per phase once ``after`` seconds have passed.

    Args:
        sink: takes one line (None: report nothing; the phases still cost nothing).
        after: seconds of planning before lines are passed on (0: every phase; None: :data:`REPORT_AFTER`).
        clock: seconds, monotonic (default :func:`time.monotonic`).
    """

    def __init__(self, sink: Callable[[str], None] | None = None, after: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sink, self.clock = sink, clock
        self.after = REPORT_AFTER if after is None else after
        self.start = clock()

    def phase(self, name: str) -> None:
        """Planning enters phase ``name`` (a few words: ``"estimating stage costs"``)."""
        if self.sink is None:
            return
        elapsed = self.clock() - self.start
        if elapsed >= self.after:
            self.sink(f"planning: {name} ({elapsed:.0f} s so far)")

    def step(self, name: str, done: int, total: int) -> None:
        """Within a phase, part ``done`` of ``total`` (a stage of a profile) begins."""
        self.phase(f"{name} {done + 1}/{total}")


#: a planner's progress that reports nothing (the default of every planning function)
SILENT = Progress()
