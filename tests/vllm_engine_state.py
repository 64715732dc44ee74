"""What a vLLM engine holds, read inside its actor: the refit tests compare it bitwise; and the
colocated refit those tests drive from the test process. Importable as ``vllm_engine_state``."""

from __future__ import annotations

from typing import Any

import ray
import torch

from nemo_rl.models.generation.vllm import VllmGeneration


def engine_state(generation: VllmGeneration) -> dict[str, Any]:
    """Engine 0's ``load_path`` (how its last refit was loaded, None before any),
    ``in_checkpoint_format`` (whether loading in place is exact) and ``checksums``
    (``{parameter name: (shape, sha256 of its bytes)}``)."""

    def state(worker: Any) -> dict[str, Any]:
        import hashlib

        from nemo_rl.models.generation.vllm.weight_loading import in_checkpoint_format

        def digest(t: torch.Tensor) -> str:
            return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()

        def sums(model: torch.nn.Module) -> dict[str, Any]:
            return {
                "in_checkpoint_format": in_checkpoint_format(model),
                "checksums": {n: (tuple(p.shape), digest(p)) for n, p in model.named_parameters()},
            }

        return {"load_path": worker.last_load_path, **worker.llm.apply_model(sums)[0]}

    return ray.get(generation.worker_group.workers[0].__ray_call__.remote(state))


def colocated_refit(sender: Any, generation: VllmGeneration) -> None:
    """One colocated refit with the sender (a ``RefitSender``) in this process, as
    refit_policy_generation runs it: the bucket stream, every engine's checks, the commit."""
    checks = []
    for keys in sender.prepare_weights_for_ipc().plan:
        bucket = sender.get_weights_ipc_handles(keys)
        checks += generation.refit("update_weights_from_ipc_handles", bucket)
    ray.get(checks)
    ray.get(generation.refit("commit_weight_update"))
    sender.finish_weights_ipc()
