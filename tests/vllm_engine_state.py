"""What a vLLM engine holds, read inside its actor: the refit tests compare it bitwise; and the
colocated refit those tests drive from the test process. Importable as ``vllm_engine_state``."""

from __future__ import annotations

from collections.abc import Callable
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


def colocated_refit(sender: Any, generation: VllmGeneration, timeout_s: float = 120.0) -> list:
    """One colocated refit with the sender (a ``RefitSender`` in this process, on the engines'
    node) writing the one ring every rank of every engine reads, as refit_policy_generation
    runs it: the engines load while the sender packs. Returns the engines' reports."""
    tp = generation.layout.tensor_parallel_size
    stream = sender.prepare_weights_for_ipc({sender.rank: generation.num_replicas * tp})
    loads = [
        engine.refit.remote(
            "update_weights_from_ipc_handles",
            [(stream, e * tp + t) for t in range(tp)],
            timeout_s,
        )
        for e, engine in enumerate(generation.engines)
    ]
    try:
        sender.get_weights_ipc_handles([n for bucket in stream.plan for n in bucket])
        return ray.get(loads)
    finally:
        sender.finish_weights_ipc()


def _refit_while_packing(sender: Any, load: Callable[[Any], Any]) -> Any:
    """Open a stream of ``sender`` (a ``RefitSender`` of this process) with one reader, pack
    it on a thread while ``load(stream)`` reads it; ``load``'s result."""
    import threading

    stream = sender.prepare_weights_for_ipc({sender.rank: 1})
    packing = threading.Thread(
        target=sender.get_weights_ipc_handles, args=([n for b in stream.plan for n in b],)
    )
    packing.start()
    try:
        return load(stream)
    finally:
        packing.join()
        sender.finish_weights_ipc()


def ring_refit_in_process(llm: Any, sender: Any, reload: bool = False) -> dict[str, Any]:
    """One refit of ``llm`` (an in-process ``vllm.LLM`` of one rank) from ``sender`` (a
    ``RefitSender`` of this process) through its ring, with the engine's real loading function
    (``reload``: vLLM's reload path even where loading in place is exact); the rank's report."""
    from nemo_rl.models.generation.refit.ipc import RingRead
    from nemo_rl.models.generation.vllm.weight_loading import load_from_rings

    def load(stream: Any) -> dict[str, Any]:
        (report,) = llm.collective_rpc(
            load_from_rings,
            args=([RingRead(stream.ring, 0)], sender.info, stream.bucket_bytes, stream.version,
                  60.0, reload),
        )
        return report

    report = _refit_while_packing(sender, load)
    assert report["error"] is None, report["error"]
    return report


def worker_refit_in_process(worker: Any, sender: Any) -> dict[str, Any]:
    """One refit of ``worker`` (a ``VllmGenerationWorker`` of this process, not an actor, its
    engine of one rank started) from ``sender`` through the receiver's verbs, as the driver
    runs them; the receiver's result."""
    worker.refit("prepare_refit_info", sender.info)
    return _refit_while_packing(
        sender,
        lambda stream: worker.refit("update_weights_from_ipc_handles", [(stream, 0)], 60.0),
    )
