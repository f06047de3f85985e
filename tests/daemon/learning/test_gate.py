"""The promotion gate on constructed paired outcomes (no model needed): better on the recent held-out
samples with confidence, no loss on the old classes beyond the evidence, no known class at 0 %."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgerev_daemon.config import PromotionConfig
from edgerev_daemon.learning.evidence import Paired, binomial_tail, paired
from edgerev_daemon.learning.promote import HeldOut, Scores, comparisons, dead_classes, judge, recent_flags
from edgerev_daemon.storage.records import Sample, Split

DIGITS = tuple(str(d) for d in range(10))


def outcomes(spec: dict[str, tuple[int, int, int, int]], recent: bool = True) -> list[tuple[str, bool, bool, bool]]:
    """``{label: (both right, only candidate, only current, neither)}`` as ``(label, cand, cur, recent)`` rows."""
    rows = []
    for label, (both, cand, cur, neither) in spec.items():
        rows += [(label, True, True, recent)] * both + [(label, True, False, recent)] * cand
        rows += [(label, False, True, recent)] * cur + [(label, False, False, recent)] * neither
    return rows


def build(rows, cand_known=None, cur_known=None) -> tuple[HeldOut, Scores, Scores]:
    labels = tuple(r[0] for r in rows)
    held = HeldOut(labels, tuple(r[3] for r in rows))
    cand = Scores(tuple(r[1] for r in rows), tuple(cand_known or dict.fromkeys(labels)))
    cur = Scores(tuple(r[2] for r in rows), tuple(cur_known or dict.fromkeys(labels)))
    return held, cand, cur


def test_the_issue_scenario_learns_five_digits_and_loses_two_old_samples():
    # 80 old held-out samples (digits 0-4): the current model has all right, the candidate loses 2; 70 new
    # (digits 5-9, unknown to the current model): the candidate gets 68 right
    spec = {d: (16, 0, 0, 0) for d in "01234"} | {d: (0, 14, 0, 0) for d in "5678"} | {"9": (0, 12, 0, 2)}
    spec["0"], spec["1"] = (15, 0, 1, 0), (15, 0, 1, 0)
    held, cand, cur = build(outcomes(spec), cur_known=tuple("01234"))
    d = judge(held, cand, cur, PromotionConfig())
    assert d.promote, d.reason
    assert d.reason.startswith("better on the recent held-out samples by 44.0 points (68 gained, 2 lost of 150): "
                               "too many gains to be chance (p = ")
    assert "classes the model in service does not know count as wrong for it" in d.reason
    assert ("old classes 2.5 points lower (0 gained, 2 lost of 80): no evidence of a loss over 2.0 points "
            "(p = 0.81, promotion.alpha 0.05)") in d.reason
    assert d.metrics["current"]["new_classes"] == 0.0 and d.metrics["candidate"]["old_classes"] == 78 / 80
    assert d.metrics["test"]["old_classes"] == {"n": 80, "gained": 0, "lost": 2, "p_worse": pytest.approx(0.81)}


def test_a_candidate_that_forgets_twenty_of_eighty_is_refused_with_how_much_and_how_sure():
    spec = {d: (12, 0, 4, 0) for d in "01234"} | {d: (0, 14, 0, 0) for d in "56789"}
    held, cand, cur = build(outcomes(spec), cur_known=tuple("01234"))
    d = judge(held, cand, cur, PromotionConfig())
    assert not d.promote
    assert d.reason.startswith("worse on the old classes by 25.0 points (20 of 80 lost, 0 gained): too many losses "
                               "to be chance, more than the allowed 2.0 points (p = 4.4e-06, promotion.alpha 0.05)"), \
        d.reason
    plain = judge(held, cand, cur, PromotionConfig(forgetting_margin=0.0))  # McNemar's own test: 2^-20
    assert "gained): too many losses to be chance (p = 9.5e-07, promotion.alpha 0.05)" in plain.reason
    assert judge(held, cand, cur, PromotionConfig(forgetting_margin=0.3)).promote  # the owner allows that much


def test_a_small_gain_is_not_evidence_and_the_reason_says_so():
    spec = {"a": (40, 3, 1, 6), "b": (45, 0, 0, 5)}
    held, cand, cur = build(outcomes(spec))
    d = judge(held, cand, cur, PromotionConfig())
    assert not d.promote
    assert d.reason == ("not better with confidence on the recent held-out samples: +2.0 points (3 gained, 1 lost of "
                        "100): chance alone could give as much (p = 0.312, promotion.alpha 0.05)")
    assert judge(held, cand, cur, PromotionConfig(alpha=0.5)).promote


def test_only_recent_samples_are_compared():
    # the candidate follows the drift: better on the recent samples, worse on the old ones of the same classes
    rows = outcomes({"a": (0, 0, 30, 0), "b": (0, 0, 30, 0)}, recent=False)
    rows += outcomes({"a": (5, 20, 0, 5), "b": (5, 20, 0, 5)})
    held, cand, cur = build(rows)
    d = judge(held, cand, cur, PromotionConfig())
    assert d.promote and d.metrics["heldout_samples"] == {"all": 120, "recent": 60}
    assert d.metrics["candidate"]["all"] == 50 / 120 and d.metrics["candidate"]["recent"] == 50 / 60
    everything = build([(label, c, r, True) for label, c, r, _ in rows])
    assert not judge(*everything, PromotionConfig()).promote  # judged on its whole history it would lose


def test_a_known_class_at_zero_is_refused_and_named():
    spec = {"a": (10, 0, 0, 0), "class9": (0, 0, 0, 24)} | {c: (0, 20, 0, 0) for c in "bc"}
    held, cand, cur = build(outcomes(spec), cur_known=("a",))
    d = judge(held, cand, cur, PromotionConfig())
    assert not d.promote and d.reason == ("refused: class class9 at 0 % on its 24 recent held-out samples "
                                          "(promotion.refuse_class_at_zero)")
    assert judge(held, cand, cur, PromotionConfig(refuse_class_at_zero=False)).promote  # configured otherwise
    # too few samples to judge the class
    assert judge(held, cand, cur, PromotionConfig(min_heldout_per_class=25)).promote
    held, cand, _ = build(outcomes({"a": (30, 0, 0, 0), "b": (30, 0, 0, 0), "class9": (0, 0, 0, 6)}))
    first = judge(held, cand, None, PromotionConfig())
    assert not first.promote and first.reason == ("first model refused: class class9 at 0 % on its 6 recent held-out "
                                                  "samples (promotion.refuse_class_at_zero)")


def test_a_class_the_candidate_does_not_know_is_not_a_dead_class():
    held, cand, _ = build(outcomes({"a": (10, 0, 0, 0), "b": (0, 0, 0, 10)}), cand_known=("a",))
    assert dead_classes(held, cand, PromotionConfig()) == []


def test_a_first_model_beats_chance_or_waits():
    held, cand, _ = build(outcomes({"a": (6, 0, 0, 4), "b": (5, 0, 0, 5)}))
    d = judge(held, cand, None, PromotionConfig())
    assert d.promote and d.reason == "first model: recent held-out accuracy 0.5500 (chance 0.5000)"
    held, cand, _ = build(outcomes({"a": (5, 0, 0, 5), "b": (5, 0, 0, 5)}))
    assert judge(held, cand, None, PromotionConfig()).reason == (
        "first model at chance: recent held-out accuracy 0.5000 (chance 0.5000)")
    assert judge(HeldOut((), ()), Scores((), ("a",)), None, PromotionConfig()).promote  # nothing held out yet


def sample(label: str, at: float, batch: int) -> Sample:
    return Sample(f"{batch:08x}{at}", label, Split.HELDOUT, 32, 32, "0" * 64, "x.png", at, batch)


def test_each_class_is_judged_on_the_window_before_its_newest_sample():
    day = 86400.0
    samples = [sample("a", 0.0, 1), sample("b", 0.0, 1), sample("a", 40 * day, 2), sample("a", 45 * day, 3),
               sample("b", 5 * day, 3)]
    assert recent_flags(samples, 30.0) == [False, True, True, True, True]  # b stopped arriving: its last month
    assert recent_flags(samples, None) == [True] * 5
    # a clock that jumped back: the newest sample by arrival is 10 days "before" an older one; both stay in
    jumped = [sample("a", 100 * day, 1), sample("a", 90 * day, 2), sample("a", 10 * day, 0)]
    assert recent_flags(jumped[:2], 30.0) == [True, True]


# properties ---------------------------------------------------------------------------------------------

@given(n=st.integers(0, 60), k=st.integers(-2, 62), p=st.floats(0.01, 0.99))
def test_binomial_tail_is_the_sum_of_its_terms(n, k, p):
    exact = sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(max(k, 0), n + 1))
    assert binomial_tail(k, n, p) == pytest.approx(exact, rel=1e-9, abs=1e-300)
    assert binomial_tail(k, n, 0.5) == pytest.approx(sum(math.comb(n, j) for j in range(max(k, 0), n + 1)) / 2**n)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 400), gained=st.integers(0, 200), lost=st.integers(0, 200),
       margin=st.floats(0.0, 0.2), alpha=st.sampled_from([0.01, 0.05, 0.1]))
def test_the_tests_are_monotone_and_margin_zero_is_mcnemar(n, gained, lost, margin, alpha):
    assume(gained + lost <= n)
    p = Paired(n, gained, lost)
    # a margin only makes a loss harder to claim
    assert 0.0 <= p.p_worse(0.0) <= p.p_worse(margin) + 1e-12 and p.p_worse(margin) <= 1.0
    assert p.p_worse(0.0) == Paired(n, lost, gained).p_better()  # McNemar's test, the other way round
    if lost + 1 + gained <= n:  # one more loss is more evidence of a loss, and less of a gain
        assert Paired(n, gained, lost + 1).p_worse(margin) <= p.p_worse(margin) + 1e-12
        assert Paired(n, gained, lost + 1).p_better() >= p.p_better() - 1e-12
    if lost <= gained:
        assert p.p_worse(margin) >= 0.5 - 1e-12  # never evidence of a loss when it did not lose more than it gained
    if margin * n >= gained + lost:
        assert p.p_worse(margin) == 1.0  # even losing every discordant sample stays within the margin


@st.composite
def scenarios(draw):
    """Old classes (the current model knows them) and new ones, each with a sample count and the two models'
    accuracies; outcomes drawn as paired right/wrong flags."""
    rows = []
    old = draw(st.integers(1, 4))
    for c in range(old + draw(st.integers(0, 4))):
        n = draw(st.integers(1, 40))
        known = c < old
        for _ in range(n):
            cur = known and draw(st.booleans())
            rows.append((f"c{c}", draw(st.booleans()), cur, draw(st.booleans())))
    return rows, tuple(f"c{c}" for c in range(old))


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), alpha=st.sampled_from([0.01, 0.05, 0.2]), margin=st.sampled_from([0.0, 0.02, 0.1]),
       minimum=st.integers(1, 10))
def test_every_decision_follows_the_evidence_and_says_why(scenario, alpha, margin, minimum):
    rows, old = scenario
    held, cand, cur = build(rows, cur_known=old)
    gate = PromotionConfig(alpha=alpha, forgetting_margin=margin, min_heldout_per_class=minimum)
    d = judge(held, cand, cur, gate)
    assert d.reason and "\n" not in d.reason
    now, lost = comparisons(held, cand, cur)
    assert now == paired([r[1] for r in rows if r[3]], [r[2] for r in rows if r[3]])
    assert d.promote == (now.n > 0 and now.p_better() <= alpha and lost.p_worse(margin) > alpha
                         and not dead_classes(held, cand, gate)), d.reason
    if d.promote:
        assert now.gained > now.lost  # evidence of a gain is never a loss in point estimate
    if lost.p_worse(margin) <= alpha:
        assert d.reason.startswith(f"worse on the old classes by {100 * -lost.change:.1f} points ({lost.lost} of "
                                   f"{lost.n} lost, {lost.gained} gained): too many losses to be chance")
    first = judge(held, cand, None, gate)
    assert first.reason and (not first.promote or not dead_classes(held, cand, gate))


def test_the_fleet_judge_adopts_within_the_evidence_and_refuses_beyond_it():
    from edgerev_daemon.learning.fleet import fleet_judge

    # the fleet model knows two more classes; on this device's own classes it loses 2 of 60: within the noise
    spec = {"a": (28, 0, 2, 0), "b": (30, 0, 0, 0), "c": (0, 10, 0, 0), "d": (0, 10, 0, 0)}
    held, cand, cur = build(outcomes(spec), cur_known=("a", "b"))
    adopt, why = fleet_judge(held, cand, cur, PromotionConfig())
    assert adopt and why.startswith("fleet model on this device's recent held-out samples: +22.5 points (20 gained, "
                                    "2 lost of 80): no evidence of a loss over 2.0 points (p = 1"), why
    held, cand, cur = build(outcomes({"a": (10, 0, 20, 0), "b": (30, 0, 0, 0)}))  # forgets most of a
    adopt, why = fleet_judge(held, cand, cur, PromotionConfig())
    assert not adopt and why.startswith("fleet model worse on this device's recent held-out samples by 33.3 points "
                                        "(0 gained, 20 lost of 60): too many losses to be chance (p = "), why
    first, why = fleet_judge(held, cand, None, PromotionConfig())
    assert first and why == "fleet model, first in service: recent held-out accuracy 0.6667"
