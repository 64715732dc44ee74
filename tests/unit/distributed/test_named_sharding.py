"""Tests for nemo_rl.distributed.named_sharding (pure, no Ray)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from nemo_rl.distributed.named_sharding import NamedSharding

PP, DP, CP, TP = 2, 3, 1, 2
AXES = {"pp": PP, "dp": DP, "cp": CP, "tp": TP}


def megatron_rank(pp: int, dp: int, cp: int, tp: int) -> int:
    """Megatron's rank order, written out: tp fastest, then cp, dp, pp."""
    return ((pp * DP + dp) * CP + cp) * TP + tp


@pytest.fixture
def sharding() -> NamedSharding:
    return NamedSharding.from_axis_sizes(AXES)


def all_coords() -> list[dict[str, int]]:
    return [
        dict(zip(AXES, c)) for c in itertools.product(*(range(s) for s in AXES.values()))
    ]


def test_layout_follows_megatron_order(sharding: NamedSharding) -> None:
    assert sharding.names == ["pp", "dp", "cp", "tp"]
    assert sharding.shape == AXES
    assert sharding.world_size == PP * DP * CP * TP
    for coords in all_coords():
        rank = megatron_rank(**coords)
        assert sharding.get_rank_coords(rank) == coords
        assert sharding.get_ranks(**coords) == [rank]
    assert [sharding.get_axis_size(n) for n in AXES] == [PP, DP, CP, TP]


def test_get_ranks_with_free_axes(sharding: NamedSharding) -> None:
    for dp in range(DP):
        expected = sorted(megatron_rank(**c) for c in all_coords() if c["dp"] == dp)
        assert sharding.get_ranks(dp=dp) == expected
    assert sharding.get_ranks(pp=1, tp=0) == [megatron_rank(1, d, 0, 0) for d in range(DP)]
    assert sharding.get_ranks() == list(range(sharding.world_size))


def test_ranks_by_axis_are_the_communication_groups(sharding: NamedSharding) -> None:
    for axis in AXES:
        groups = sharding.get_ranks_by_axis(axis)
        # Independent reference: group ranks by all coordinates except `axis`.
        expected: dict[tuple[int, ...], list[int]] = {}
        for coords in all_coords():
            key = tuple(v for k, v in coords.items() if k != axis)
            expected.setdefault(key, []).append(megatron_rank(**coords))
        assert groups == [expected[k] for k in sorted(expected)]
        assert sorted(r for g in groups for r in g) == list(range(sharding.world_size))
    assert sharding.get_ranks_by_axis("tp")[:2] == [[0, 1], [2, 3]]


def test_custom_layout() -> None:
    layout = np.array([[3, 1], [0, 2]])
    sharding = NamedSharding(layout, ["dp", "tp"])
    assert sharding.get_rank_coords(3) == {"dp": 0, "tp": 0}
    assert sharding.get_rank_coords(2) == {"dp": 1, "tp": 1}
    assert sharding.get_ranks(tp=1) == [1, 2]
    assert sharding.get_ranks_by_axis("dp") == [[3, 0], [1, 2]]
    assert sharding == NamedSharding(layout.copy(), ["dp", "tp"])
    assert sharding != NamedSharding.from_axis_sizes({"dp": 2, "tp": 2})


@pytest.mark.parametrize(
    ("layout", "names", "error", "match"),
    [
        (np.arange(4).reshape(2, 2), ["dp"], ValueError, "one axis name per layout dimension"),
        (np.arange(4).reshape(2, 2), ["dp", "dp"], ValueError, "repeat"),
        (np.arange(4).reshape(2, 2), ["dp", "TP"], ValueError, "'TP' is invalid"),
        (np.array([[0, 1], [1, 3]]), ["dp", "tp"], ValueError, "exactly once"),
        (np.zeros((2, 2)) + 0.5, ["dp", "tp"], TypeError, "integer ranks"),
    ],
)
def test_invalid_layouts(layout: np.ndarray, names: list[str], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        NamedSharding(layout, names)


def test_invalid_queries_name_the_axis(sharding: NamedSharding) -> None:
    with pytest.raises(ValueError, match="axis 'ep' is unknown"):
        sharding.get_axis_size("ep")
    with pytest.raises(ValueError, match="axis 'ep' is unknown"):
        sharding.get_ranks(ep=0)
    with pytest.raises(ValueError, match=r"dp=3 is outside \[0, 3\) of axis 'dp'"):
        sharding.get_ranks(dp=3)
    with pytest.raises(ValueError, match=r"rank 12 is outside \[0, 12\)"):
        sharding.get_rank_coords(12)
    with pytest.raises(ValueError, match="axis 'tp' has size 0"):
        NamedSharding.from_axis_sizes({"dp": 2, "tp": 0})
