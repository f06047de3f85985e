"""What a run says while it trains (lines, progress.json, the caller's hook) and early stopping on a
held-out plateau: the lines at their cadence (an injected clock), the plateau rule over any history,
a resumed run stopping where an uninterrupted one does, and bad input."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerev.config import ConfigError, from_dict
from edgerev.train.config import RunConfig
from edgerev.train.progress import Pacer, Plateau, Progress, duration, read_progress
from edgerev.train.trainer import RunError, train

from .test_trainer import recipe


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cfg(**over) -> RunConfig:
    return from_dict(RunConfig, recipe(**over))


def test_one_line_per_epoch_off_a_terminal_then_the_end(tmp_path, capsys):
    clock = Clock()
    seen = []

    def tick():  # polled once per step: each step takes two seconds of the injected clock
        clock.now += 2.0
        return False

    r = train(cfg(), tmp_path / "run", stop=tick, clock=clock, report=seen.append)
    lines = capsys.readouterr().err.strip().splitlines()
    assert r.status == "done" and r.total_steps == 24
    # stderr is not a terminal under pytest: lines, no bar; the last epoch's line is the final one
    assert [line.split(" step")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert "step 8/24" in lines[0] and "val acc " in lines[0] and "0.50 steps/s ETA 32s" in lines[0]
    assert lines[-1].endswith("| done") and "step 24/24" in lines[-1]
    assert [p.line() for p in seen] == lines
    assert read_progress(r.out) == seen[-1].to_json() and seen[-1].state == "done"
    assert seen[0].val_acc is not None and seen[0].best_epoch == 1


def test_lines_at_a_fixed_cadence_within_long_epochs(tmp_path, capsys):
    clock = Clock()

    def tick():
        clock.now += 25.0
        return False

    train(cfg(train__epochs=1, train__progress_seconds=60), tmp_path / "run", stop=tick, clock=clock)
    lines = capsys.readouterr().err.strip().splitlines()
    # 8 steps of 25 s: a line once 60 s have passed (steps 3 and 6), then the end of the epoch (the run's last)
    assert [line.split(" loss")[0] for line in lines] == ["epoch 1/1 step 3/8", "epoch 1/1 step 6/8",
                                                          "epoch 1/1 step 8/8"]
    assert "val acc" not in lines[0] and "ETA" in lines[0] and lines[-1].endswith("| done")


def test_quiet_prints_nothing_and_still_writes_the_progress_file(tmp_path, capsys):
    r = train(cfg(train__epochs=1), tmp_path / "run", progress=False)
    assert capsys.readouterr().err == ""
    assert read_progress(r.out)["state"] == "done"


def test_a_stopped_run_says_so_and_its_resume_continues(tmp_path, capsys):
    calls = {"n": 0}

    def stop_at_5():
        calls["n"] += 1
        return calls["n"] == 5

    r = train(cfg(), tmp_path / "run", stop=stop_at_5)
    assert r.status == "stopped" and read_progress(r.out)["state"] == "stopped" and read_progress(r.out)["step"] == 5
    assert train(None, r.out, resume=True).status == "done"
    assert read_progress(r.out)["state"] == "done"


NOISY = {"val__samples": 64}


def plateau_cfg(**over) -> RunConfig:
    """Validation data no model can learn (noise drowns the classes): held-out figures wander, so the
    run must stop on a plateau before its maximum of 30 epochs."""
    c = recipe(train__epochs=30, train__patience=2, optim__lr=0.2, optim__schedule="constant", **over)
    c["data"]["val"]["noise"] = 400.0
    c["train"]["batch"] = 64
    return from_dict(RunConfig, c)


@pytest.mark.slow
def test_a_plateau_ends_the_run_early_and_the_summary_says_why(tmp_path):
    r = train(plateau_cfg(), tmp_path / "run", progress=False)
    early = r.summary["stopped_early"]
    evals = [json.loads(x) for x in (r.out / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["kind"] == "eval"]
    plateau = Plateau(2, evals)
    assert early is not None and r.step < r.total_steps
    assert early["epoch"] == plateau.ran_out and Plateau(2, evals[:plateau.ran_out]).stop
    assert early["annealed_epochs"] == 2 == len(evals) - plateau.ran_out  # then annealed (train.anneal_epochs)
    assert "no held-out gain for 2 epochs" in early["reason"] and "then annealed over 2 epochs" in early["reason"]
    assert read_progress(r.out)["state"] == "plateau" and (r.out / "model.json").is_file()


@pytest.mark.slow
def test_a_resumed_run_stops_on_the_same_plateau(tmp_path):
    whole = train(plateau_cfg(), tmp_path / "whole", progress=False)
    calls = {"n": 0}

    def stop_once():
        calls["n"] += 1
        return calls["n"] == 9  # in the third epoch (4 steps each), after two evaluations

    part = train(plateau_cfg(), tmp_path / "part", stop=stop_once, progress=False)
    assert part.status == "stopped"
    resumed = train(None, part.out, resume=True, progress=False)
    assert resumed.step == whole.step and resumed.summary["stopped_early"] == whole.summary["stopped_early"]
    assert resumed.summary["weights_sha256"] == whole.summary["weights_sha256"]


epochs = st.lists(st.tuples(st.one_of(st.none(), st.sampled_from([0.1, 0.5, 0.9, 1.0])),
                            st.floats(0.0, 3.0, allow_nan=False)), min_size=1, max_size=30)


@given(history=epochs, patience=st.integers(1, 5))
def test_the_plateau_rule_over_any_history(history, patience):
    """Stop exactly when ``patience`` epochs passed since the best one (accuracy first, loss on ties)."""
    p = Plateau(patience)
    best, ran_out = None, None  # (acc, -loss, epoch); the first epoch that stopped, kept once set
    for epoch, (acc, loss) in enumerate(history, start=1):
        p.update(epoch, acc, loss)
        if acc is not None and (best is None or (acc, -loss) > best[:2]):
            best = (acc, -loss, epoch)
        assert p.best_epoch == (best and best[2])
        assert p.stop == (best is not None and epoch - best[2] >= patience)
        ran_out = ran_out or (epoch if p.stop else None)
        assert p.ran_out == ran_out and (p.reason() is None) == (ran_out is None)
    assert Plateau(patience, [{"epoch": e, "acc": a, "loss": lo} for e, (a, lo) in
                              enumerate(history, start=1)]).stop == p.stop


def test_the_pacer_and_the_line_format():
    clock = Clock()
    pacer = Pacer(60, clock)
    assert not pacer.due(False)
    clock.now += 59.9
    assert not pacer.due(False) and pacer.due(True)  # an epoch's end always reports, and restarts the count
    clock.now += 60
    assert pacer.due(False) and not pacer.due(False)
    p = Progress("running", 150, 1000, 3, 20, 0.812, 0.21, 4.1, 207.3, 0.712, 0.93, 0.72, 2)
    assert p.line() == ("epoch 3/20 step 150/1000 loss 0.8120 lr 0.21 | val acc 71.2% loss 0.9300 "
                        "(best 72.0% at epoch 2) | 4.10 steps/s ETA 3m27s")
    assert [duration(s) for s in (0, 59.6, 187, 7500)] == ["0s", "1m00s", "3m07s", "2h05m"]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("patience", 0, "train.patience: must be at least 1 epoch"),
    ("patience", -3, "train.patience: must be at least 1 epoch"),
    ("anneal_epochs", -1, "train.anneal_epochs: must be >= 0"),
    ("progress_seconds", 0, "train.progress_seconds: must be positive"),
])
def test_bad_settings_are_one_line_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        from_dict(RunConfig, recipe(**{f"train__{key}": value}))


def test_patience_without_held_out_samples_is_refused_before_anything_is_written(tmp_path):
    c = recipe(train__patience=2, data__val_fraction=0.0)
    del c["data"]["val"]
    with pytest.raises(RunError, match="train.patience stops on held-out figures, but no sample is held out"):
        train(from_dict(RunConfig, c), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
