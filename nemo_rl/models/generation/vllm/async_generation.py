"""Driver-side facade over asynchronous vLLM replicas (``vllm_cfg.async_engine``).

:class:`AsyncVllmGeneration` is :class:`VllmGeneration` (same construction, batched
``generate``, sleep, refit) over :class:`AsyncVllmGenerationWorker` replicas, plus
:meth:`~AsyncVllmGeneration.generate_async`: one awaitable call per sample's turn, routed to
replica ``seed_key[0] % replicas`` so a sample keeps its engine (and the engine's cached prefix
of its conversation) from turn to turn. :func:`vllm_generation` picks the facade the config
asks for.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.config import GenerationConfig
from nemo_rl.models.generation.interfaces import (
    AsyncGenerationInterface,
    GenerationDatumSpec,
    GenerationOutputSpec,
)
from nemo_rl.models.generation.vllm.async_worker import AsyncVllmGenerationWorker
from nemo_rl.models.generation.vllm.vllm_generation import (
    VllmGeneration,
    _request_seed,
    _validate_batch,
)


class AsyncVllmGeneration(VllmGeneration, AsyncGenerationInterface):
    """vLLM replicas that generate each call's rows as soon as they arrive (arguments:
    :class:`VllmGeneration`)."""

    worker_class = AsyncVllmGenerationWorker

    async def generate_async(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        greedy: bool = False,
        *,
        seed_key: tuple[int, ...],
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate the rows of ``data`` on replica ``seed_key[0] % replicas`` while other
        calls run; row ``r`` samples with the seed of ``(*seed_key, r)``.

        Raises:
            ValueError: a malformed batch (as :meth:`generate`) or an empty ``seed_key``.
            EngineTimeout: no answer within ``config.generate_timeout_s`` (names the engine,
                its node and the bound).
        """
        size = _validate_batch(data)
        if not seed_key:
            raise ValueError("seed_key must name the call, e.g. (sampling_step, sample, turn)")
        replica = seed_key[0] % self.num_replicas
        seeds = [_request_seed(self.seed, *seed_key, row) for row in range(size)]
        timeout_s = self.config.generate_timeout_s
        try:
            return await asyncio.wait_for(
                self.engines[replica].generate.remote(data, greedy, seeds), timeout_s
            )
        except asyncio.TimeoutError:
            raise self.timed_out(
                [replica], "generate", timeout_s, "policy.generation.generate_timeout_s"
            ) from None

    def reserve_sampling_step(self) -> int:
        """The current ``sampling_step``, then advanced by one."""
        step = self.sampling_step
        self.sampling_step += 1
        return step


def vllm_generation(
    cluster: RayVirtualCluster, config: GenerationConfig, model_path: str, **kwargs: Any
) -> VllmGeneration:
    """The facade ``config`` asks for: :class:`AsyncVllmGeneration` when
    ``vllm_cfg.async_engine`` is set, else :class:`VllmGeneration` (``kwargs``: theirs)."""
    facade = AsyncVllmGeneration if config.vllm_cfg.async_engine else VllmGeneration
    return facade(cluster, config, model_path, **kwargs)
