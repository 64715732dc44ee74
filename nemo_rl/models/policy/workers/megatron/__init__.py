"""The Megatron-Core policy worker, split by concern.

``model_setup`` (process groups, model, DDP, optimizer, scheduler), ``forward`` (micro-batch
inputs -> logprobs, padded or packed, CP-split), ``train_step`` (global batch -> optimizer step),
``checkpointing`` (dist checkpoints), ``reference`` (the frozen initial weights) and ``offload``
(device memory release around refit). :class:`~nemo_rl.models.policy.workers.
megatron_policy_worker.MegatronPolicyWorker` wires them.
"""

import importlib
from types import ModuleType

# The parts that import megatron-core load on first use: the driver imports the worker class
# (Ray needs it to start the actors) but never runs it, and megatron-core's import costs seconds.
_IMPORTED_ON_FIRST_USE = ("checkpointing", "forward", "model_setup", "offload", "train_step")


def __getattr__(name: str) -> ModuleType:
    if name in _IMPORTED_ON_FIRST_USE:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
