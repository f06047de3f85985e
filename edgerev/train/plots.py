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
    _save(figure(rows, plan, title), path)


def _save(fig, path: str | Path) -> None:
    from io import BytesIO

    import matplotlib.pyplot as plt

    from edgerev.atomic import atomic_write

    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def plot_classes(evaluation: dict, path: str | Path, title: str = "") -> None:
    """Write ``path`` (PNG): the :func:`classes_figure` of an evaluation (:func:`edgerev.train.evaluate.evaluate`)."""
    _save(classes_figure(evaluation, title), path)


def classes_figure(evaluation: dict, title: str = ""):
    """Per-class accuracy (one bar per class, its held-out samples beside it) and the confusion matrix
    (rows: the true class, columns: the predicted one; each cell's count written in it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conf = evaluation["confusion"]
    labels, columns, matrix = conf["labels"], conf["predicted"], conf["matrix"]
    n = len(labels)
    fig, (ax_acc, ax_conf) = plt.subplots(1, 2, figsize=(6 + 0.5 * n, 1.8 + 0.45 * n),
                                          gridspec_kw={"width_ratios": [1, 1.3]})
    per_class = evaluation.get("per_class", {})
    samples = [sum(row) for row in matrix]
    values = [per_class.get(c) for c in labels]
    ax_acc.barh(range(n), [v or 0.0 for v in values],
                color=["#c92a2a" if v == 0 else "#1971c2" for v in values])
    ax_acc.set_yticks(range(n), [f"{c} ({k})" for c, k in zip(labels, samples, strict=True)], fontsize=8)
    for i, v in enumerate(values):
        ax_acc.text(min(v or 0.0, 0.98), i, "no samples" if v is None else f" {100 * v:.0f} %", va="center",
                    ha="right" if (v or 0) > 0.5 else "left", fontsize=7, color="white" if (v or 0) > 0.5 else "black")
    ax_acc.set_xlim(0, 1)
    ax_acc.invert_yaxis()
    ax_acc.set_xlabel("accuracy (held-out samples)")
    most = max((max(row) for row in matrix if row), default=0)
    ax_conf.imshow(matrix or [[0]], cmap="Blues", vmin=0, vmax=max(1, most), aspect="auto")
    for i, row in enumerate(matrix):
        for j, k in enumerate(row):
            if k:
                ax_conf.text(j, i, str(k), ha="center", va="center", fontsize=7,
                             color="white" if k > most / 2 else "black")
    ax_conf.set_yticks(range(n), labels, fontsize=8)
    ax_conf.set_xticks(range(len(columns)), columns, fontsize=8, rotation=60, ha="right")
    ax_conf.set_xlabel("predicted")
    ax_conf.set_ylabel("true")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


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
