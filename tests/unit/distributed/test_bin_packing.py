"""Tests of the bin packers used by sequence packing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from nemo_rl.distributed.bin_packing import (
    PACKERS,
    descending_order,
    first_fit_decreasing,
    modified_first_fit_decreasing,
)


def test_first_fit_decreasing_known_bins() -> None:
    assert first_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]


def test_modified_first_fit_decreasing_known_bins() -> None:
    # Capacity 60: 40 and 31 are large, 14 and 13 small, 6 tiny. FFD puts 14 with 40; MFFD
    # puts the two small items (smallest first) with 31, the emptiest large bin.
    sizes = [40, 31, 14, 13, 6]
    assert first_fit_decreasing(sizes, 60) == [[0, 2, 4], [1, 3]]
    assert modified_first_fit_decreasing(sizes, 60) == [[0, 4], [1, 3, 2]]


@pytest.mark.parametrize("name", sorted(PACKERS))
def test_oversized_item_is_named(name: str) -> None:
    with pytest.raises(ValueError, match="item 1 of size 11 does not fit a bin of capacity 10"):
        PACKERS[name]([3, 11], 10)


def test_descending_order_breaks_ties_by_item() -> None:
    assert descending_order(range(4), [2, 5, 2, 7]) == [3, 1, 0, 2]


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    extra=st.integers(0, 40),
    name=st.sampled_from(sorted(PACKERS)),
)
def test_bin_packing_respects_capacity_and_places_every_item_once(sizes, extra, name) -> None:
    capacity = max(sizes) + extra
    bins = PACKERS[name](sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(b and sum(sizes[i] for i in b) <= capacity for b in bins)
