"""The CUDA cap's fraction: whichever device total the allocator multiplies and however it maps its pages,
the bytes it may reserve stay within the budget. Runs without a GPU; the allocator itself is checked
by the GPU tests (tests/train/test_cap.py, tests/test_cuda_campaign.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerev.errors import EdgerevError
from edgerev.train.cap import EXPANDABLE_PAGE, cuda_cap_fraction, expandable_segments

MiB = 2**20
GRANULE = 2 * MiB  # the allocator rounds every block to it; an expandable segment maps whole pages


def allowed_by_allocator(fraction: float, total: int) -> int:
    """What the allocator computes from the fraction: ``static_cast<size_t>(fraction * total)``."""
    return int(fraction * float(total))


@given(budget=st.integers(1, 2**40), extra=st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)),
       expandable=st.booleans())
def test_the_allocator_reserves_at_most_the_budget_whichever_total_it_multiplies(budget, extra, expandable):
    totals = (budget + extra[0], budget + extra[1])
    if expandable and budget <= EXPANDABLE_PAGE:
        with pytest.raises(EdgerevError, match="expandable"):
            cuda_cap_fraction(budget, totals, expandable)
        return
    fraction = cuda_cap_fraction(budget, totals, expandable)
    # with expandable segments a request that passes the check may map up to a page, less a granule, more
    overshoot = EXPANDABLE_PAGE - GRANULE if expandable else 0
    for total in totals:
        assert allowed_by_allocator(fraction, total) + overshoot <= budget
    # and no more is kept back than that: under the larger total the allocator gets all the rest
    assert allowed_by_allocator(fraction, max(totals)) >= budget - (EXPANDABLE_PAGE if expandable else 0) - 1


def test_a_cap_above_the_device_is_refused_naming_both():
    with pytest.raises(EdgerevError, match="more than the device's 1,000 bytes"):
        cuda_cap_fraction(1001, (1000, 2000), expandable=False)


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : true"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, False),
    # torch's newer versions read only the first when both are set, older ones only the second: either counts
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     True),
])
def test_expandable_segments_are_read_as_torch_reads_its_allocator_settings(environ, expected):
    assert expandable_segments(environ) is expected
