"""Bin packing of integer item sizes into bins of a fixed capacity (sequence packing).

Each packer takes ``sizes`` (e.g. the token lengths of samples) and a ``capacity`` (tokens per
bin) and returns bins as lists of item positions in ``sizes``; every item lands in exactly one
bin and no bin's total exceeds the capacity. :data:`PACKERS` maps the names that configs use
(``policy.sequence_packing.algorithm``) to the packers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

PackingAlgorithm = Literal["first_fit_decreasing", "modified_first_fit_decreasing"]

# A packer: (sizes, capacity) -> bins of item positions.
Packer = Callable[[Sequence[int], int], list[list[int]]]


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items into bins of ``capacity``: largest first, each into the first bin with room.

    Returns bins as lists of item positions in ``sizes``.
    """
    _check_fits(sizes, capacity)
    bins: list[list[int]] = []
    loads: list[int] = []
    _first_fit(bins, loads, descending_order(range(len(sizes)), sizes), sizes, capacity)
    return bins


def modified_first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items into bins of ``capacity`` with a variant of Johnson and Garey's modified FFD.

    Items are classed by size ``s`` relative to ``C = capacity``: large ``s > C/2``, medium
    ``C/3 < s <= C/2``, small ``C/6 < s <= C/3``, tiny the rest.

    1. Every large item opens its own bin, largest first.
    2. From the fullest large bin to the emptiest, each receives the largest medium item that
       still fits (at most one fits next to a large item).
    3. From the emptiest large bin to the fullest, if the two smallest remaining small items fit
       together, the bin receives the smallest, then the largest small item that still fits.
    4. All remaining items, largest first, go first-fit into the bins, opening new ones as needed.

    Every placement checks the capacity, so no bin exceeds it. Returns bins as lists of item
    positions in ``sizes``.
    """
    _check_fits(sizes, capacity)
    order = descending_order(range(len(sizes)), sizes)
    large = [i for i in order if 2 * sizes[i] > capacity]
    medium = [i for i in order if 3 * sizes[i] > capacity >= 2 * sizes[i]]
    small = [i for i in order if 6 * sizes[i] > capacity >= 3 * sizes[i]]
    tiny = [i for i in order if capacity >= 6 * sizes[i]]
    bins = [[i] for i in large]
    loads = [sizes[i] for i in large]

    def place_largest_fitting(b: int, candidates: list[int]) -> None:
        for position, i in enumerate(candidates):  # candidates are in descending size
            if loads[b] + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                del candidates[position]
                return

    for b in range(len(bins)):
        place_largest_fitting(b, medium)
    for b in reversed(range(len(bins))):
        if len(small) < 2:
            break
        if loads[b] + sizes[small[-1]] + sizes[small[-2]] <= capacity:
            smallest = small.pop()
            bins[b].append(smallest)
            loads[b] += sizes[smallest]
            place_largest_fitting(b, small)
    _first_fit(bins, loads, descending_order(medium + small + tiny, sizes), sizes, capacity)
    return bins


PACKERS: dict[str, Packer] = {
    "first_fit_decreasing": first_fit_decreasing,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
}


def descending_order(items: Sequence[int] | range, weights: Sequence[int]) -> list[int]:
    """``items`` (indices into ``weights``) by descending weight, ties by ascending item."""
    return sorted(items, key=lambda i: (-weights[i], i))


def _first_fit(
    bins: list[list[int]],
    loads: list[int],
    items: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
) -> None:
    """Put each item into the first bin with room, opening a new bin when none has (in place)."""
    for i in items:
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])


def _check_fits(sizes: Sequence[int], capacity: int) -> None:
    for i, size in enumerate(sizes):
        if size > capacity:
            raise ValueError(f"item {i} of size {size} does not fit a bin of capacity {capacity}")
