"""A run that early stopping ends anneals first: the tail's shape over any schedule (hypothesis), a real run's
rate at every step, and a run killed before or inside its tail resuming to the same rate at every step and
the same weights as one never interrupted."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerev.train.config import OptimConfig
from edgerev.train.progress import Plateau
from edgerev.train.schedule import lr_at, scheduled, tail_after
from edgerev.train.trainer import train

from .test_progress import plateau_cfg


@given(schedule=st.sampled_from(["onecycle", "linear", "constant"]), warmup=st.floats(0.05, 0.5),
       per_epoch=st.integers(1, 20), epochs=st.integers(2, 40), ran_out=st.integers(1, 40),
       anneal=st.integers(0, 6))
def test_the_tail_falls_from_the_schedule_to_near_zero_within_the_maximum(schedule, warmup, per_epoch, epochs,
                                                                         ran_out, anneal):
    cfg = OptimConfig(lr=0.1, schedule=schedule, warmup=warmup)
    total = epochs * per_epoch
    tail = tail_after(min(ran_out, epochs), per_epoch, anneal, total)
    assert tail.start == min(ran_out, epochs) * per_epoch and tail.start <= tail.end <= total
    assert tail.end - tail.start == min(anneal * per_epoch, total - tail.start)
    for step in range(tail.start):  # before the tail: the schedule, untouched
        assert lr_at(step, total, cfg, tail) == scheduled(step, total, cfg) == lr_at(step, total, cfg)
    rates = [lr_at(step, total, cfg, tail) for step in range(tail.start, tail.end)]
    if rates:
        lr0, steps = scheduled(tail.start, total, cfg), len(rates)
        assert rates[0] == pytest.approx(lr0)  # continuous where it starts
        assert all(b <= a for a, b in zip(rates, rates[1:], strict=False))
        # the last step: lr0 * sin^2(pi / 2L) <= lr0 * (pi / 2L)^2, near 0 however short the tail
        assert rates[-1] <= lr0 * (math.pi / (2 * steps)) ** 2 + 1e-12


def _rates(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["lr"]) for r in rows if r["kind"] == "train"]


@pytest.mark.slow
def test_a_run_that_patience_ends_anneals_its_rate_to_near_zero(tmp_path):
    r = train(plateau_cfg(train__log_every=1), tmp_path / "run", progress=False)
    early = r.summary["stopped_early"]
    per_epoch, lr = 4, 0.2  # plateau_cfg: 256 samples, batch 64; a constant schedule at 0.2
    rates = _rates(r.out)
    assert [s for s, _ in rates] == list(range(1, r.step + 1))  # every step logged, the last one too
    start = early["epoch"] * per_epoch
    assert r.step == start + 2 * per_epoch < r.total_steps
    assert all(v == lr for _, v in rates[:start])
    tail = [v for _, v in rates[start:]]
    assert tail[0] == pytest.approx(lr) and all(b < a for a, b in zip(tail, tail[1:], strict=False))
    assert tail[-1] == pytest.approx(lr * math.sin(math.pi / 16) ** 2)  # 8 steps: 3.8 % of lr at the last


@pytest.mark.slow
def test_anneal_zero_stops_where_patience_runs_out(tmp_path):
    r = train(plateau_cfg(train__anneal_epochs=0), tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (r.out / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in rows if e["kind"] == "eval"]
    assert r.summary["stopped_early"]["epoch"] == len(evals) == Plateau(2, evals).ran_out
    assert r.summary["stopped_early"]["annealed_epochs"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before the tail", "inside the tail"])
def test_a_resumed_run_anneals_where_an_uninterrupted_one_does(tmp_path, where):
    whole = train(plateau_cfg(train__log_every=1), tmp_path / "whole", progress=False)
    start = whole.summary["stopped_early"]["epoch"] * 4
    cut = 5 if where == "before the tail" else start + 3  # mid-epoch, past the epoch patience ran out on
    polls = []

    def stop_at_cut():
        polls.append(1)
        return len(polls) == cut

    part = train(plateau_cfg(train__log_every=1), tmp_path / "part", stop=stop_at_cut, progress=False)
    assert part.status == "stopped" and part.step == cut
    resumed = train(None, part.out, resume=True, progress=False)
    assert _rates(resumed.out) == _rates(whole.out)  # the same rate at every step, exactly
    assert resumed.summary["stopped_early"] == whole.summary["stopped_early"]
    assert resumed.summary["weights_sha256"] == whole.summary["weights_sha256"]
