"""Which generation replicas died or hang, and the faults that stop a run for them.

A replica is dead when one of its actors is (killed, crashed, its node gone), or when the
engine on its rank 0 fails its health check (one of the engine's tensor-parallel rank
processes died: vLLM shuts the engine down). It hangs when it does not answer the check within
its bound (a stopped process, a deadlock, a stuck device).
:meth:`~nemo_rl.models.generation.vllm.VllmGeneration.restart_dead_engines` restarts both
kinds; past ``policy.generation.max_engine_restarts`` it raises :class:`EngineFault`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ray
from ray.actor import ActorHandle

from nemo_rl.utils.errors import ResumableFault, error_line


class EngineFault(ResumableFault):
    """A vLLM engine died or hung once more than ``policy.generation.max_engine_restarts``
    allows, or could not be restarted; the message names the engine and its node. Exit code
    75: the rerun resumes from the newest checkpoint."""


class EngineTimeout(ResumableFault, TimeoutError):
    """vLLM engines gave no result for a call within its bound (they are stopped, hung, or
    slower than the bound allows); the message names the engines, their nodes, the call, the
    seconds and the config key. Exit code 75 when the run stops on it."""


def bound_text(timeout_s: float, key: str) -> str:
    """``"600 s (policy.generation.call_timeout_s)"``: a bound and the config key setting it."""
    return f"{timeout_s:g} s ({key})"


def dead_replicas(
    workers: Sequence[ActorHandle],
    tensor_parallel_size: int,
    timeout_s: float,
    timeout_key: str,
    unanswered: Mapping[int, str] | None = None,
) -> dict[int, str]:
    """``{replica: what happened}`` of the dead and hung replicas among ``workers`` (a
    generation worker group's actors in rank order, ``tensor_parallel_size`` per replica, the
    engine on each replica's first): each rank-0 actor runs ``check_engine``, the others
    answer a ping, all within ``timeout_s`` seconds together (config key ``timeout_key``).

    What happened reads ``died (<error>)`` or ``hung (<what it did not answer>)``;
    ``unanswered`` (replica: e.g. ``no result for generate within 3600 s (...)``) is what the
    caller saw of a replica before the check, named first when the replica hangs."""
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
            before = (unanswered or {}).get(replica)
            missed = (
                f"its rank {rank % tensor_parallel_size} answered no health check within "
                f"{bound_text(timeout_s, timeout_key)}"
            )
            dead[replica] = f"hung ({before}; then {missed})" if before else f"hung ({missed})"
            continue
        try:
            ray.get(check)  # ready: its answer or its error
        except Exception as err:  # its death, or the engine's failed check
            dead[replica] = f"died ({error_line(err)})"
    return dead
