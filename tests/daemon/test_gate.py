"""The promotion gate on scores (no model needed): better on new data, no worse on old, no known class
left at 0 % on enough held-out samples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev_daemon.promote import Gate, Scores, dead_classes, judge


def scores(new: float | None, old: float | None, per_class: dict[str, tuple[int, int]],
           known: tuple[str, ...] | None = None) -> Scores:
    right = sum(r for r, _ in per_class.values())
    total = sum(n for _, n in per_class.values())
    acc = {"new": new, "old": old, "all": right / total if total else None}
    return Scores(acc, {c: list(v) for c, v in per_class.items()}, known or tuple(per_class),
                  samples={"all": total})


def test_better_and_not_worse_is_promoted():
    d = judge(scores(0.9, 0.95, {"a": (9, 10), "b": (8, 10)}), scores(0.5, 0.96, {"a": (9, 10), "b": (0, 10)}),
              Gate(tolerance=0.02))
    assert d.promote and d.reason == "better on the held-out new samples: 0.9000 vs 0.5000, old 0.9500 vs 0.9600"
    assert d.metrics["candidate"]["per_class"] == {"a": 0.9, "b": 0.8}


def test_a_known_class_at_zero_is_refused_and_named():
    cand = scores(0.9, 0.95, {"a": (10, 10), "class9": (0, 24)})
    cur = scores(0.5, 0.95, {"a": (10, 10), "class9": (0, 24)}, known=("a",))
    d = judge(cand, cur, Gate())
    assert not d.promote and "class class9 at 0 % on its 24 held-out samples" in d.reason
    assert judge(cand, cur, Gate(refuse_class_at_zero=False)).promote  # configured otherwise
    assert judge(cand, cur, Gate(min_heldout_per_class=25)).promote  # too few samples to judge the class
    first = judge(scores(None, None, {"a": (30, 30), "b": (30, 30), "class9": (0, 6)}), None, Gate())
    assert not first.promote and first.reason == ("first model refused: class class9 at 0 % on its 6 held-out "
                                                  "samples (promotion.refuse_class_at_zero)")


def test_a_class_the_candidate_does_not_know_is_not_a_dead_class():
    cand = scores(0.9, None, {"a": (10, 10), "b": (0, 10)}, known=("a",))
    assert dead_classes(cand, Gate()) == []


@settings(max_examples=300, deadline=None)
@given(per_class=st.dictionaries(st.sampled_from("abcdef"), st.tuples(st.integers(0, 30), st.integers(0, 30)),
                                 min_size=1),
       new=st.none() | st.floats(0, 1), old=st.none() | st.floats(0, 1),
       cur_new=st.floats(0, 1), cur_old=st.floats(0, 1), min_per_class=st.integers(1, 10))
def test_the_gate_never_promotes_a_dead_class_and_always_says_why(per_class, new, old, cur_new, cur_old,
                                                                  min_per_class):
    per_class = {c: (min(r, n), n) for c, (r, n) in per_class.items()}
    gate = Gate(min_heldout_per_class=min_per_class)
    cand = scores(new, old, per_class)
    for cur in (None, scores(cur_new, cur_old, per_class)):
        d = judge(cand, cur, gate)
        assert d.reason and "\n" not in d.reason
        if d.promote and cand.accuracy["all"] is not None:
            assert dead_classes(cand, gate) == []
        if dead_classes(cand, gate) and d.promote:
            raise AssertionError(d.reason)
