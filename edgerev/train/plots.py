"""The run's picture: loss and accuracy curves, and the memory plan, in one PNG (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

MODE_COLOURS = {"invert": "#2b8a3e", "recompute": "#74b816", "store": "#c92a2a", "store8": "#e8590c",
                "store4": "#f59f00", "checkpoint": "#1971c2", "plain": "#868e96", "auto": "#868e96"}


# one style per accuracy series: where the series coincide (old and new classes both at 100 %), the
# hollow large marker of the first stays visible around the smaller ones drawn over it
SERIES = (("acc", "all classes", {"marker": "o", "ms": 9, "mfc": "none", "ls": "-", "lw": 2.5, "zorder": 2}),
          ("old_acc", "old classes", {"marker": "s", "ms": 6, "ls": "--", "lw": 1.8, "zorder": 3}),
          ("new_acc", "new classes", {"marker": "^", "ms": 4, "ls": ":", "lw": 1.4, "zorder": 4}))


def _epoch_axis(evals: list[dict]):
    """Steps to epochs (fractional), from the evaluations' step and epoch; ``None`` before the first."""
    for r in evals:
        if r.get("epoch"):
            per_epoch = r["step"] / r["epoch"]
            return lambda step: step / per_epoch
    return None


def _legend_below(ax) -> None:
    """The legend under the axes, never over the data."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)


def plot_run(rows: list[dict], plan: dict, path: str | Path, title: str = "") -> None:
    """Write ``path`` (PNG): the :func:`figure` of a run's metrics rows and memory plan."""
    from io import BytesIO

    import matplotlib.pyplot as plt

    from edgerev.atomic import atomic_write

    fig = figure(rows, plan, title)
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def figure(rows: list[dict], plan: dict, title: str = ""):
    """Training loss, validation loss, validation accuracy (all, old, new classes) against the epoch,
    and one bar per stage coloured by the mode the plan gave it; legends below their axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    to_epoch = _epoch_axis(evals)
    x = (lambda r: to_epoch(r["step"])) if to_epoch else (lambda r: r["step"])
    xlabel = "epoch" if to_epoch else "step"
    fig, (ax_loss, ax_acc, ax_plan) = plt.subplots(1, 3, figsize=(15, 4.8))
    ax_loss.plot([x(r) for r in train], [r["loss"] for r in train], label="training loss", lw=1, color="#1971c2")
    ax_loss.plot([x(r) for r in evals], [r["loss"] for r in evals], "o-", label="validation loss", color="#e8590c")
    ax_loss.set_xlabel(xlabel)
    ax_loss.set_ylabel("loss")
    _legend_below(ax_loss)
    continual = any(r.get("old_acc") is not None for r in evals)
    for key, label, style in SERIES:
        pts = [(x(r), r[key]) for r in evals if r.get(key) is not None]
        if pts and (key == "acc" or continual):
            ax_acc.plot(*zip(*pts), label=label, **style)
    ax_acc.set_ylim(-0.02, 1.02)
    ax_acc.set_xlabel(xlabel)
    ax_acc.set_ylabel("validation accuracy")
    ax_acc.grid(alpha=0.3)
    if evals:
        _legend_below(ax_acc)
    stages = plan.get("stages", [])
    if stages:
        modes = [st["mode"] for st in stages]
        ax_plan.barh(range(len(stages)), [1] * len(stages), color=[MODE_COLOURS.get(m, "#495057") for m in modes])
        ax_plan.set_yticks(range(len(stages)), [f"{i} {st['type']}" for i, st in enumerate(stages)], fontsize=7)
        for i, m in enumerate(modes):
            ax_plan.text(0.5, i, m, ha="center", va="center", color="white", fontsize=7)
        ax_plan.invert_yaxis()
        ax_plan.set_xticks([])
    else:
        ax_plan.axis("off")
    head = f"memory plan: {plan.get('mode', '?')}"
    if "budget_bytes" in plan:
        head += (f"\nbudget {plan['budget_bytes'] / 2**20:.1f} MiB, peak {plan['predicted_peak_bytes'] / 2**20:.1f}"
                 f" MiB, micro-batch {plan['micro_batch']} x {plan['micro_batches']}")
    ax_plan.set_title(head, fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
