"""Placement of tensor-parallel generation engines on bundles (pure arithmetic, no Ray)."""

from __future__ import annotations

import pytest

from nemo_rl.distributed.named_sharding import NamedSharding
from nemo_rl.models.generation.placement import GenerationLayout, plan_generation_layout


def test_replicas_are_bundles_over_tensor_parallel_size_on_every_node():
    layout = plan_generation_layout([4, 4], 2)
    assert layout == GenerationLayout(replicas=4, tensor_parallel_size=2)
    assert [list(layout.engine_bundles(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan_generation_layout([3], 1) == GenerationLayout(replicas=3, tensor_parallel_size=1)


def test_worker_group_rank_order_puts_each_replica_on_its_bundles():
    # RayWorkerGroup places rank r on bundle r; its rank order over the layout's axes (last
    # axis fastest) must give replica r's tp ranks exactly engine_bundles(r).
    layout = plan_generation_layout([8, 8], 4)
    sharding = NamedSharding.from_axis_sizes(layout.sharding_axes)
    for rank in range(sharding.world_size):
        coords = sharding.get_rank_coords(rank)
        bundles = layout.engine_bundles(coords["dp"])
        assert bundles[coords["tp"]] == rank
        assert bundles[0] // 8 == bundles[-1] // 8  # one node


@pytest.mark.parametrize(
    ("per_node", "tp", "fits"), [([8, 8], 3, "[1, 2, 4, 8]"), ([2, 4], 4, "[1, 2]")]
)
def test_engine_that_would_cross_a_node_is_refused_with_the_values_that_fit(per_node, tp, fits):
    with pytest.raises(ValueError) as info:
        plan_generation_layout(per_node, tp, "a source", field="x.tensor_parallel_size")
    message = str(info.value)
    assert message.startswith(f"x.tensor_parallel_size={tp} does not divide")
    assert f"Set it to one of {fits}" in message


def test_engine_bundles_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"replica must be in \[0, 2\)"):
        plan_generation_layout([4], 2).engine_bundles(2)
