"""The fleet's class registry and count-weighted averaging (numpy only; runs without Flower)."""

import numpy as np
import pytest

from edgerev.fleet.aggregate import ClassRegistry, Contribution, aggregate, grow_rows


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
