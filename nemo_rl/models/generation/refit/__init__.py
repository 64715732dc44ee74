"""Weight refit: stream the policy's HF-named weights into the generation engines.

Modules, one concern each:
    interfaces: the weight-sync protocol (sender and receiver verbs), its settings.
    buckets: stream layout (buckets of whole tensors), packing (sender), checks (receiver).
    expert_groups: each MoE layer's experts stacked into the tensors vLLM's loader takes.
    ring: a few bucket-sized slots through which one writer streams to a node's readers.
    shared_memory / cuda_ipc / ipc: the shareable buffers rings live in, by device.
    plan: which policy rank writes the ring each colocated engine rank reads.
    collective: the non-colocated transport (a broadcast group of its own).
    sender / receiver: what a policy rank and an engine do (the workers only wire them up).
    orchestrate: the driver's sequence, :func:`refit_policy_generation`.

Only ``orchestrate`` needs Ray; it is imported on first use of its names so that the transport
(sender, receiver, ipc) imports where Ray is not installed (``scripts/gpu_check.sh``).
"""

from typing import Any

from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.interfaces import RefitSettings

__all__ = ["RefitError", "RefitResult", "RefitSettings", "refit_policy_generation"]
_ORCHESTRATE_NAMES = ("RefitResult", "refit_policy_generation")


def __getattr__(name: str) -> Any:
    if name in _ORCHESTRATE_NAMES:
        from nemo_rl.models.generation.refit import orchestrate

        return getattr(orchestrate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
