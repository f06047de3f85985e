"""Exit statuses of every ``edgerev`` command, the daemon's too (docs/reference/commands.md and ``--help``)."""

OK = 0
PARTIAL = 1  # it ran, but not everything succeeded: a job failed, an image was unreadable, a check found a problem
USAGE = 2  # bad input: one line on stderr, nothing done
WARNINGS = 3  # it ran and found only warnings (edgerev doctor: every line ok or warning)
PIPE = 141  # stdout closed early (`... | head`): quiet, as a tool killed by SIGPIPE
STOPPED = 143  # `daemon once` stopped by SIGTERM before its cycle ended (128 + 15, as the shell reports a kill)

EPILOG = ("exit status: 0 success; 1 it ran but something failed (named on stderr); 2 bad input (one line on "
          "stderr, nothing done); 3 warnings only (doctor); 141 the output pipe closed early; 143 daemon once "
          "stopped by SIGTERM before its cycle ended")
