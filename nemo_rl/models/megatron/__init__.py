"""megatron-core integration: CPU accommodations and parallel-state set-up."""

from nemo_rl.models.megatron.cpu_compat import apply_cpu_compat, model_parallel_manual_seed
from nemo_rl.models.megatron.parallel_state_utils import (
    destroy_megatron_parallel,
    find_free_port,
    initialize_megatron_parallel,
)

__all__ = [
    "apply_cpu_compat",
    "destroy_megatron_parallel",
    "find_free_port",
    "initialize_megatron_parallel",
    "model_parallel_manual_seed",
]
