"""``edgerev ARGS...`` in a process of its own that says on stdout when it reaches a point, so a test can
send it a signal at that point instead of guessing with sleeps (not collected by pytest).

    python train_child.py POINT -- ARGS...

``POINT`` is ``step`` (a training step finished) or ``checkpoint`` (a checkpoint was written); each time
the run reaches it the child prints ``@POINT N`` (N: the step) and flushes.
"""

from __future__ import annotations

import sys


def announce(point: str) -> None:
    import edgerev.train.trainer as trainer

    if point == "checkpoint":
        real_save = trainer.save_checkpoint

        def save_checkpoint(out, step, *args, **kwargs):
            result = real_save(out, step, *args, **kwargs)
            print(f"@checkpoint {step}", flush=True)
            return result

        trainer.save_checkpoint = save_checkpoint
    elif point == "step":
        real_step, steps = trainer.train_step, [0]

        def train_step(*args, **kwargs):
            result = real_step(*args, **kwargs)
            steps[0] += 1
            print(f"@step {steps[0]}", flush=True)
            return result

        trainer.train_step = train_step
    else:
        raise SystemExit(f"unknown point {point!r}")


def main() -> int:
    point, sep, *args = sys.argv[1:]
    assert sep == "--", sys.argv
    announce(point)
    from edgerev.cli import main as edgerev

    return edgerev(args)


if __name__ == "__main__":
    sys.exit(main())
