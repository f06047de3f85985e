"""The fleet's class registry and count-weighted averaging (numpy only; runs without Flower)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev.fleet.aggregate import (
    ClassRegistry,
    Contribution,
    aggregate,
    as_moments,
    as_variances,
    average_from_sums,
    grow_rows,
    term_scales,
    weighted_terms,
)


def test_registry_keeps_rows_and_appends_new_names_sorted():
    r = ClassRegistry(["cat", "ant"])
    assert r.classes == ("ant", "cat")
    assert r.learn(["dog", "cat", "bee"]) == ["bee", "dog"]
    assert r.classes == ("ant", "cat", "bee", "dog") and r.row("cat") == 1


def test_head_rows_weighted_by_each_devices_count_of_that_class():
    prev = {"head.weight": np.zeros((3, 2), np.float32), "head.bias": np.full(3, 7.0, np.float32),
            "body.w": np.zeros(2, np.float32)}
    a = Contribution({"head.weight": np.ones((3, 2), np.float32), "head.bias": np.ones(3, np.float32),
                      "body.w": np.ones(2, np.float32)}, examples=30, counts=[30, 0, 0])
    b = Contribution({"head.weight": np.full((3, 2), 4.0, np.float32), "head.bias": np.full(3, 4.0, np.float32),
                      "body.w": np.full(2, 4.0, np.float32)}, examples=10, counts=[10, 0, 0])
    c = Contribution({"head.weight": np.full((3, 2), 9.0, np.float32), "head.bias": np.full(3, 9.0, np.float32),
                      "body.w": np.full(2, 9.0, np.float32)}, examples=20, counts=[0, 20, 0])
    out = aggregate([a, b, c], prev)
    # row 0: devices a and b by their counts 30 and 10; row 1: only c; row 2: nobody, the previous row stays
    np.testing.assert_allclose(out["head.weight"][0], (30 * 1 + 10 * 4) / 40)
    np.testing.assert_allclose(out["head.weight"][1], 9.0)
    np.testing.assert_allclose(out["head.bias"], [(30 + 40) / 40, 9.0, 7.0])
    # the rest: by each device's total count
    np.testing.assert_allclose(out["body.w"], (30 * 1 + 10 * 4 + 20 * 9) / 60)


def test_grow_rows_adds_zero_rows_to_the_head_only():
    out = grow_rows({"head.weight": np.ones((2, 3)), "head.bias": np.ones(2), "body.w": np.ones(4)}, 4)
    assert out["head.weight"].shape == (4, 3) and not out["head.weight"][2:].any()
    assert out["head.bias"].tolist() == [1, 1, 0, 0] and out["body.w"].shape == (4,)


def test_mismatched_contribution_is_refused():
    prev = {"head.weight": np.zeros((2, 2))}
    with pytest.raises(ValueError, match="counts 3 classes"):
        aggregate([Contribution({"head.weight": np.zeros((2, 2))}, 1, [1, 0, 0])], prev)


@st.composite
def _rounds(draw):
    """A round: the tensors sent, and each device's answer (some counts 0, some devices with no sample)."""
    rows, devices = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sent = {"head.weight": rng.normal(size=(rows, 3)).astype(np.float32),
            "head.bias": rng.normal(size=rows).astype(np.float32), "body.w": rng.normal(size=(2, 2)).astype(np.float32)}
    contributions = []
    for _ in range(devices):
        counts = draw(st.lists(st.sampled_from([0, 0, 1, 7, 300]), min_size=rows, max_size=rows))
        arrays = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in sent.items()}
        contributions.append(Contribution(arrays, sum(counts), counts))
    return sent, contributions


@settings(max_examples=60, deadline=None)
@given(_rounds())
def test_the_sums_of_the_weighted_terms_give_the_same_average(round_):
    """Secure aggregation only learns sums: the sums of the devices' weighted terms must give exactly what
    :func:`aggregate` gives from their tensors (rows nobody counted keep theirs, as does everything when
    nobody had a sample)."""
    sent, contributions = round_
    scales = term_scales([c.examples for c in contributions], [c.counts for c in contributions])
    terms = [weighted_terms({k: c.arrays[k].astype(np.float64) - sent[k] for k in sent}, c.examples, c.counts, scales)
             for c in contributions]
    sums = [np.sum(parts, axis=0) for parts in zip(*terms, strict=True)]
    assert max(float(np.abs(t).max()) for part in terms for t in part[:2]) <= 1.0  # every weight scaled to <= 1
    expected, got = aggregate(contributions, sent), average_from_sums(sums, sent)
    assert list(got) == list(expected)
    for k in sent:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-5)


def test_sums_of_another_layout_are_refused():
    sent = {"head.weight": np.zeros((2, 2)), "body.w": np.zeros(3)}
    good = [np.ones(1), np.ones(2), np.ones(3), np.ones((2, 2))]  # weights, rows, then tensors by name
    assert set(average_from_sums(good, sent)) == set(sent)
    with pytest.raises(ValueError, match="layout"):
        average_from_sums(good[:-1], sent)
    with pytest.raises(ValueError, match="shape"):
        average_from_sums([*good[:2], np.ones(4), np.ones((2, 2))], sent)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5), seed=st.integers(0, 10_000),
       spread=st.floats(0.0, 5.0))
def test_statistics_averaged_as_moments_are_those_of_all_the_devices_samples_together(sizes, seed, spread):
    """Each device's batch norm measured its input's mean and variance over its own samples (means apart by up
    to ``spread``: label skew); the fleet's statistics, averaged as moments by sample count, in clear or from
    secure aggregation's sums of updates, are the mean and variance of every device's samples pooled."""
    rng = np.random.default_rng(seed)
    data = [rng.normal(rng.uniform(-spread, spread, 3), rng.uniform(0.5, 2.0, 3), (n, 3)) for n in sizes]
    prev = as_moments({"bn.running_mean": np.zeros(3), "bn.running_var": np.ones(3)})
    sent = [as_moments({"bn.running_mean": x.mean(0), "bn.running_var": x.var(0)}) for x in data]
    pooled = np.concatenate(data)
    clear = as_variances(aggregate([Contribution(s, len(x), []) for s, x in zip(sent, data)], prev))
    scales = term_scales(sizes, [[] for _ in sizes])
    sums = [sum(parts) for parts in zip(*(weighted_terms({k: s[k] - prev[k] for k in s}, len(x), [], scales)
                                          for s, x in zip(sent, data)))]
    secure = as_variances(average_from_sums(sums, prev))
    for out in (clear, secure):
        np.testing.assert_allclose(out["bn.running_mean"], pooled.mean(0), atol=1e-9)
        # (at least the floor of 1e-5: one sample has no spread)
        np.testing.assert_allclose(out["bn.running_var"], np.maximum(pooled.var(0), 1e-5), rtol=1e-9, atol=1e-9)
    # a variance averaged as such misses exactly the spread of the devices' means
    plain = sum(len(x) * x.var(0) for x in data) / len(pooled)
    between = sum(len(x) * (x.mean(0) - pooled.mean(0)) ** 2 for x in data) / len(pooled)
    np.testing.assert_allclose(pooled.var(0) - plain, between, atol=1e-9)


def test_moments_turn_back_into_variances_and_leave_other_tensors_alone():
    import torch

    arrays = {"a.running_mean": np.array([1.0, -2.0]), "a.running_var": np.array([0.5, 3.0]),
              "b.running_var": np.array([4.0]), "head.weight": np.ones((2, 2))}
    m = as_moments(arrays)
    np.testing.assert_allclose(m["a.running_var"], [1.5, 7.0])
    assert m["b.running_var"] is arrays["b.running_var"] and m["head.weight"] is arrays["head.weight"]
    np.testing.assert_allclose(as_variances(m)["a.running_var"], arrays["a.running_var"])
    # an average of rounded moments may dip below the mean's square: the variance stays positive
    low = as_variances({"a.running_mean": torch.tensor([2.0]), "a.running_var": torch.tensor([3.9999])})
    assert float(low["a.running_var"][0]) == pytest.approx(1e-5)
