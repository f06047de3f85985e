"""The run's picture: loss and accuracy curves, and the memory plan, in one PNG (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

MODE_COLOURS = {"invert": "#2b8a3e", "recompute": "#74b816", "store": "#c92a2a", "store8": "#e8590c",
                "store4": "#f59f00", "checkpoint": "#1971c2", "plain": "#868e96", "auto": "#868e96"}


def plot_run(rows: list[dict], plan: dict, path: str | Path, title: str = "") -> None:
    """Write ``path``: training loss, validation loss, validation accuracy (all, old, new classes)
    against the step, and one bar per stage coloured by the mode the plan gave it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, (ax_loss, ax_acc, ax_plan) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    ax_loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="val loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    for key, label in (("acc", "all classes"), ("old_acc", "old classes"), ("new_acc", "new classes")):
        pts = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if pts and (key == "acc" or any(r.get("old_acc") is not None for r in evals)):
            ax_acc.plot(*zip(*pts), "o-", label=label)
    ax_acc.set_ylim(0, 1)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("validation accuracy")
    ax_acc.legend()
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
    from io import BytesIO

    from edgerev.atomic import atomic_write

    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
