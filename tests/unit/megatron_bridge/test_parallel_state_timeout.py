"""Every process group :func:`initialize_megatron_parallel` sets up (the default group and
megatron-core's TP/PP/DP/CP/EP groups, gloo ones included) times a collective out after its
``timeout_s``, so a stopped peer fails a collective instead of blocking it (megatron's own
default for its groups is 30 minutes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_bridge.parallel_state import (
    destroy_megatron_parallel,
    find_free_port,
    initialize_megatron_parallel,
)


def test_every_group_times_out_after_the_given_seconds() -> None:
    initialize_megatron_parallel(0, 1, master_port=find_free_port(), timeout_s=42)
    try:
        from megatron.core import parallel_state as ps

        groups = {
            "default": dist.group.WORLD,
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(),
            "dp_gloo": ps.get_data_parallel_group_gloo(),
            "cp": ps.get_context_parallel_group(),
            "ep": ps.get_expert_model_parallel_group(),
        }
        timeouts = {
            name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, group in groups.items()
        }
        assert timeouts == dict.fromkeys(groups, 42.0)
    finally:
        destroy_megatron_parallel()
