"""Driver-side facade over asynchronous vLLM replicas (``vllm_cfg.async_engine``).

:class:`AsyncVllmGeneration` is :class:`VllmGeneration` (same construction, batched
``generate``, sleep, refit) over :class:`AsyncVllmGenerationWorker` replicas, plus
:meth:`~AsyncVllmGeneration.generate_async`: one awaitable call per sample's turn, routed to
replica ``seed_key[0] % replicas`` so a sample keeps its engine (and the engine's cached prefix
of its conversation) from turn to turn. :func:`vllm_generation` picks the facade the config
asks for.

With ``vllm_cfg.expose_http_server`` every engine also serves its OpenAI-compatible endpoint
(:mod:`.http_server`) from its start (a restarted engine serves anew, at a new port):
:attr:`AsyncVllmGeneration.http_base_urls` lists them, and
:meth:`~AsyncVllmGeneration.take_http_records` collects what they recorded for a rollout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
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

    # Base URL of each engine's HTTP endpoint (empty without vllm_cfg.expose_http_server).
    http_base_urls: list[str]

    def _start_engines(self, replicas: range | list[int]) -> None:
        """Build the engines of ``replicas``, then start their HTTP servers when configured
        (within ``config.startup_timeout_s``)."""
        super()._start_engines(replicas)
        vllm_cfg = self.config.vllm_cfg
        if not vllm_cfg.expose_http_server:
            self.http_base_urls = []
            return
        if not getattr(self, "http_base_urls", None):
            self.http_base_urls = [""] * self.num_replicas
        urls = self._wait(
            [(r, self.engines[r].start_http_server.remote(vllm_cfg.http_server_host)) for r in replicas],
            "its HTTP server's start", self.config.startup_timeout_s,
            "policy.generation.startup_timeout_s",
        )
        for replica, url in zip(replicas, urls):
            self.http_base_urls[replica] = url

    def take_http_records(self, rollout_ids: Sequence[tuple[int, str]]) -> dict[str, list[Any]]:
        """What the engines recorded for each ``(replica, rollout id)`` (per rollout id, its
        :class:`~nemo_rl.models.generation.http_records.CallRecord` list), in one round trip
        per engine."""
        by_replica: dict[int, list[str]] = {}
        for replica, rid in rollout_ids:
            by_replica.setdefault(replica, []).append(rid)
        futures = [
            (r, self.engines[r].take_http_records.remote(rids)) for r, rids in by_replica.items()
        ]
        records: dict[str, list[Any]] = {}
        for part in self._wait(
            futures, "take_http_records", self.config.call_timeout_s,
            "policy.generation.call_timeout_s",
        ):
            records.update(part)
        return records

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
    ``vllm_cfg.async_engine`` or ``expose_http_server`` is set, else :class:`VllmGeneration`
    (``kwargs``: theirs)."""
    vllm_cfg = config.vllm_cfg
    facade = (
        AsyncVllmGeneration
        if vllm_cfg.async_engine or vllm_cfg.expose_http_server
        else VllmGeneration
    )
    return facade(cluster, config, model_path, **kwargs)

