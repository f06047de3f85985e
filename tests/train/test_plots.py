"""curves.png reads: epochs on the axis, every series visible where they coincide, legends off the data."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from edgerev.train.plots import figure, plot_run  # noqa: E402


def rows(per_epoch: int = 10, epochs: int = 5, continual: bool = True) -> list[dict]:
    out = []
    for e in range(1, epochs + 1):
        out += [{"kind": "train", "step": (e - 1) * per_epoch + k, "epoch": e, "loss": 1.0 / e}
                for k in range(1, per_epoch + 1)]
        ev = {"kind": "eval", "step": e * per_epoch, "epoch": e, "loss": 1.0 / e, "acc": 1.0}
        out.append(ev | ({"old_acc": 1.0, "new_acc": 1.0} if continual else {}))  # all three coincide
    return out


def test_accuracy_against_epochs_with_every_series_visible_and_legends_below():
    fig = figure(rows(), {"mode": "invert", "stages": [{"mode": "invert", "type": "HybridBlock"}]})
    try:
        ax_loss, ax_acc, _ = fig.axes
        assert ax_loss.get_xlabel() == ax_acc.get_xlabel() == "epoch"
        lines = ax_acc.get_lines()
        assert [line.get_label() for line in lines] == ["all classes", "old classes", "new classes"]
        assert list(lines[0].get_xdata()) == [1, 2, 3, 4, 5]
        # coinciding series stay apart by style: distinct markers, the first drawn largest and hollow
        assert len({line.get_marker() for line in lines}) == 3
        assert lines[0].get_markersize() > lines[1].get_markersize() > lines[2].get_markersize()
        assert lines[0].get_markerfacecolor() == "none"
        fig.canvas.draw()
        for ax in (ax_loss, ax_acc):
            legend = ax.get_legend().get_window_extent()
            assert legend.y1 <= ax.get_window_extent().y0  # entirely below the axes
    finally:
        plt.close(fig)


def test_without_evaluations_the_axis_is_the_step(tmp_path):
    fig = figure([r for r in rows(continual=False) if r["kind"] == "train"], {})
    try:
        assert fig.axes[0].get_xlabel() == "step"
    finally:
        plt.close(fig)
    plot_run(rows(continual=False), {}, tmp_path / "c.png", title="t")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_per_class_picture_names_every_class_and_counts_each_cell(tmp_path):
    from edgerev.train.evaluate import confusion
    from edgerev.train.plots import classes_figure, plot_classes

    truth = ["cat"] * 4 + ["dog"] * 3 + ["eel"] * 2
    predicted = ["cat"] * 3 + ["dog"] + ["dog"] * 3 + ["cat", "cat"]  # eel: none right
    ev = {"per_class": {"cat": 0.75, "dog": 1.0, "eel": 0.0}, "confusion": confusion(truth, predicted,
                                                                                     ["cat", "dog", "eel"])}
    assert ev["confusion"]["matrix"] == [[3, 1, 0], [0, 3, 0], [2, 0, 0]]
    fig = classes_figure(ev, "t")
    try:
        ax_acc, ax_conf = fig.axes[:2]
        assert [t.get_text() for t in ax_acc.get_yticklabels()] == ["cat (4)", "dog (3)", "eel (2)"]
        assert [round(b.get_width(), 2) for b in ax_acc.patches] == [0.75, 1.0, 0.0]
        texts = [t.get_text().strip() for t in ax_acc.texts]
        assert texts == ["75 %", "100 %", "0 %"]
        assert sorted(t.get_text() for t in ax_conf.texts) == ["1", "2", "3", "3"]  # the non-zero cells
        assert [t.get_text() for t in ax_conf.get_xticklabels()] == ["cat", "dog", "eel"]
    finally:
        plt.close(fig)
    plot_classes(ev, tmp_path / "classes.png")
    assert (tmp_path / "classes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
