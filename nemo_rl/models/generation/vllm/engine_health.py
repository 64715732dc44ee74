"""Which generation replicas died, and the fault that stops a run for them.

A replica is dead when one of its actors is (killed, crashed, its node gone), when the engine
on its rank 0 fails its health check (one of the engine's tensor-parallel rank processes
died: vLLM shuts the engine down), or when it does not answer the check in time (hung).
:meth:`~nemo_rl.models.generation.vllm.VllmGeneration.restart_dead_engines` restarts such
replicas; past ``policy.generation.max_engine_restarts`` it raises :class:`EngineFault`.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
from ray.actor import ActorHandle

from nemo_rl.utils.errors import ResumableFault

# Seconds a replica has to answer a health check before it counts as dead (hung). Engines
# are checked after a call failed, when the live ones are idle.
HEALTH_CHECK_TIMEOUT_S = 60.0


class EngineFault(ResumableFault):
    """A vLLM engine died once more than ``policy.generation.max_engine_restarts`` allows, or
    could not be restarted; the message names the engine and its node. Exit code 75: the rerun
    resumes from the newest checkpoint."""


def dead_replicas(
    workers: Sequence[ActorHandle], tensor_parallel_size: int, timeout_s: float
) -> dict[int, str]:
    """``{replica: why}`` of the dead replicas among ``workers`` (a generation worker group's
    actors in rank order, ``tensor_parallel_size`` per replica, the engine on each replica's
    first): each rank-0 actor runs ``check_engine``, the others answer a ping, all within
    ``timeout_s`` seconds together."""
    checks = [
        worker.check_engine.remote() if rank % tensor_parallel_size == 0
        else worker.__ray_ready__.remote()
        for rank, worker in enumerate(workers)
    ]
    _, pending = ray.wait(checks, num_returns=len(checks), timeout=timeout_s)
    dead: dict[int, str] = {}
    for rank, check in enumerate(checks):
        replica = rank // tensor_parallel_size
        if replica in dead:
            continue
        if check in pending:
            rank_in_replica = rank % tensor_parallel_size
            dead[replica] = f"its rank {rank_in_replica} did not answer within {timeout_s:g} s"
            continue
        try:
            ray.get(check)
        except Exception as err:  # its death, or the engine's failed check
            dead[replica] = one_line(err)
    return dead


def one_line(err: BaseException) -> str:
    """``Type: first line`` of ``err``, or of the remote error a Ray task error carries."""
    cause = getattr(err, "cause", None)
    shown = cause if isinstance(cause, BaseException) else err
    lines = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {lines[0] if lines else ''}".rstrip(": ")
