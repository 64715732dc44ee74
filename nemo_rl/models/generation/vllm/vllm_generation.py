"""Driver-side facade over the vLLM generation replicas.

:class:`VllmGeneration` starts one :class:`VllmGenerationWorker` per bundle of a
:class:`RayVirtualCluster`, laid out as data-parallel replicas x tensor-parallel ranks
(:mod:`nemo_rl.models.generation.placement`: replica ``r`` holds bundles ``r*T .. r*T + T - 1``
of one node, T = ``vllm_cfg.tensor_parallel_size``), and builds each replica's engine on its
rank 0 (the engine's other ranks are vLLM processes on the replica's other bundles). It splits
every batch into contiguous chunks, one per replica (sizes differ by at most one row; replicas
without rows are skipped), and concatenates the results back in input order.

Seeds. Sampled requests get their own seed, derived from the constructor's ``seed``, the
number of ``generate`` calls made so far (:attr:`VllmGeneration.sampling_step`) and the row's
global index, so results do not depend on the number of replicas and a run repeats exactly
given the same seed and call sequence.

Engine deaths and hangs. Every wait for the engines is bounded (``config.generate_timeout_s``
for a generation, ``config.startup_timeout_s`` for a start, ``config.call_timeout_s`` for any
other call); a wait past its bound raises :class:`~.engine_health.EngineTimeout` naming the
engines that gave no result, their nodes, the call, the seconds and the config key. A call
that fails because an engine died (its actor, or one of its tensor-parallel rank processes) or
timed out raises; :meth:`VllmGeneration.restart_dead_engines` then starts every dead or hung
replica (one that answers no health check within ``call_timeout_s``) anew on its bundles, up
to ``max_engine_restarts`` times per engine (:mod:`.engine_health`). The restarted engine holds
the checkpoint's weights until the caller refits it; redoing the failed batch from the same
``sampling_step`` gives the rows an uninterrupted run would have got.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import ray
import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_faults import node_description
from nemo_rl.distributed.worker_groups import RayWorkerGroup
from nemo_rl.models.generation.config import GenerationConfig
from nemo_rl.models.generation.lora_serving import AdapterServing
from nemo_rl.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
)
from nemo_rl.models.generation.placement import plan_generation_layout
from nemo_rl.models.generation.refit.interfaces import RefitInfo
from nemo_rl.models.generation.vllm.engine_health import (
    EngineFault,
    EngineTimeout,
    bound_text,
    dead_replicas,
)
from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorker, engine_env_vars
from nemo_rl.utils.errors import error_line

logger = logging.getLogger(__name__)


class VllmGeneration(GenerationInterface):
    """vLLM engines on a Ray cluster, one per data-parallel replica.

    Args:
        cluster: bundles to run on; one replica per ``tensor_parallel_size`` bundles of a node.
        config: generation settings (sampling, ``vllm_cfg``, the bounds of every wait for the
            engines and ``max_engine_restarts``).
        model_path: Hugging Face checkpoint folder (or hub name) with its tokenizer.
        pad_token_id: token id that pads ``output_ids``.
        seed: base of every request's sampling seed (see the module docstring).
        adapters: a LoRA policy's adapters, which the engines serve themselves (refits
            stream them instead of weights; ``PolicyConfig.adapter_serving``); None: refits
            stream every weight.

    Raises:
        ValueError: a ``tensor_parallel_size`` that does not divide every node's bundles.
    """

    # The replica class each bundle runs.
    worker_class: type[VllmGenerationWorker] = VllmGenerationWorker

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: GenerationConfig,
        model_path: str,
        *,
        pad_token_id: int,
        seed: int = 0,
        adapters: AdapterServing | None = None,
    ) -> None:
        self.layout = plan_generation_layout(
            cluster.bundle_ct_per_node_list, config.vllm_cfg.tensor_parallel_size, repr(cluster)
        )
        self.config = config
        self.adapters = adapters
        self.pad_token_id = pad_token_id
        self.seed = seed
        # Restarts of each engine so far (config.max_engine_restarts bounds each).
        self.engine_restarts = [0] * self.layout.replicas
        # Number of generate() calls so far; part of every request's seed. Restore it when
        # resuming a run to continue the same random sequence.
        self.sampling_step = 0
        # {replica: the call it last gave no result for, within which bound}: named when the
        # health check finds it hung
        self._unanswered: dict[int, str] = {}
        # What the engines were last given by prepare_refit_info, and the refit group they
        # joined ((ip, port, world_size); None: none).
        self.refit_info: RefitInfo | None = None
        self.refit_group: tuple[str, int, int] | None = None
        # Public for the weight-refit layer, which talks to the workers directly.
        self.worker_group = RayWorkerGroup(
            cluster,
            self.worker_class,
            self.layout.sharding_axes,
            actor_kwargs={
                "model_path": str(model_path),
                "config": config,
                "pad_token_id": pad_token_id,
                "use_gpu": cluster.use_gpus,
                "seed": seed,
                "adapters": adapters,
            },
            env_vars=engine_env_vars(config.vllm_cfg, cluster.use_gpus),
            startup_timeout_s=config.startup_timeout_s,
        )
        # Rank 0 of each replica: the actor holding the replica's engine.
        self.engines = self.worker_group.workers[:: self.layout.tensor_parallel_size]
        try:
            self._start_engines(range(self.num_replicas))
        except BaseException:
            self.worker_group.shutdown()
            raise

    def _start_engines(self, replicas: range | list[int]) -> None:
        """Build the engines of ``replicas`` on their rank 0, giving each its ranks' GPU ids,
        within ``config.startup_timeout_s``."""
        workers = self.worker_group.workers
        ranks_of = [self.layout.engine_bundles(replica) for replica in replicas]
        bound = (self.config.startup_timeout_s, "policy.generation.startup_timeout_s")
        # one round trip for every rank's ids (not one per replica: a start-up of many engines)
        ids = self._wait(
            [(replica, workers[r].device_ids.remote())
             for replica, ranks in zip(replicas, ranks_of) for r in ranks],
            "its start (device ids)", *bound,
        )
        tp = self.layout.tensor_parallel_size
        self._wait(
            [
                (replica, workers[ranks[0]].start_engine.remote(
                    [i for rank_ids in ids[n * tp : (n + 1) * tp] for i in rank_ids]
                ))
                for n, (replica, ranks) in enumerate(zip(replicas, ranks_of))
            ],
            "its start (the engine)", *bound,
        )

    def engine_name(self, replica: int) -> str:
        """``"vLLM engine <replica> on <node> (<address>)"``."""
        rank = self.layout.engine_bundles(replica)[0]
        node = node_description(self.worker_group.worker_places(per_device=False)[rank])
        return f"vLLM engine {replica} on {node}"

    def _wait(
        self, futures: list[tuple[int, ray.ObjectRef]], call: str, timeout_s: float, key: str
    ) -> list[Any]:
        """Results of ``futures`` (``(replica, future)`` each) in their order, once all
        finished (or failed: one that died leaves the others idle) within ``timeout_s``.

        Raises:
            EngineTimeout: some gave no result in time, naming their engines, nodes, ``call``,
                the seconds and the config key ``key``.
            Whatever a finished call raised (a dead engine's ``RayActorError``...).
        """
        refs = [ref for _, ref in futures]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = sorted({replica for replica, ref in futures if ref in pending})
            raise self.timed_out(late, call, timeout_s, key)
        return ray.get(refs)

    def timed_out(
        self, replicas: list[int], call: str, timeout_s: float, key: str
    ) -> EngineTimeout:
        """The fault of ``replicas`` giving no result for ``call`` within ``timeout_s``
        (config key ``key``), remembered for the health check that follows
        (:meth:`restart_dead_engines`)."""
        missed = f"no result for {call} within {bound_text(timeout_s, key)}"
        self._unanswered.update({replica: missed for replica in replicas})
        names = "; ".join(self.engine_name(replica) for replica in replicas)
        return EngineTimeout(
            f"{names} gave {missed}: stopped, hung, or slower than the bound allows"
        )

    def _call_engines(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every replica's engine, within ``config.call_timeout_s``."""
        return self._wait(
            [(replica, getattr(engine, method).remote(*args))
             for replica, engine in enumerate(self.engines)],
            method if method != "refit" else f"refit verb {args[0]}",
            self.config.call_timeout_s, "policy.generation.call_timeout_s",
        )

    @property
    def num_replicas(self) -> int:
        """Number of engines (data-parallel replicas)."""
        return self.layout.replicas

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate one response per row; see GenerationDatumSpec / GenerationOutputSpec.

        Raises:
            ValueError: missing or malformed ``input_ids`` / ``input_lengths`` /
                ``stop_strings``, or a prompt that leaves no room under ``max_model_len``.
        """
        size = _validate_batch(data)
        step = self.sampling_step
        self.sampling_step += 1
        futures = []
        start = 0
        for replica, (worker, rows) in enumerate(
            zip(self.engines, _chunk_sizes(size, self.num_replicas))
        ):
            if rows == 0:
                continue
            shard = data.slice(start, start + rows)
            seeds = [_request_seed(self.seed, step, row) for row in range(start, start + rows)]
            futures.append((replica, worker.generate.remote(shard, greedy, seeds)))
            start += rows
        results = self._wait(
            futures, "generate", self.config.generate_timeout_s,
            "policy.generation.generate_timeout_s",
        )
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": self.pad_token_id})

    def prepare_for_generation(self, **kwargs: Any) -> bool:
        """Wake every engine (weights and KV cache back on the GPU when colocated)."""
        return all(self._call_engines("wake_up"))

    def finish_generation(self, **kwargs: Any) -> bool:
        """Put every engine to sleep (GPU colocated) or reset its prefix cache (otherwise)."""
        return all(self._call_engines("sleep"))

    def shutdown(self) -> bool:
        """Drop the engines and end their actors; the cluster's bundles stay reserved."""
        return self.worker_group.shutdown(cleanup_method="shutdown")

    # ------------------------------------------------------------------ engine deaths

    def restart_dead_engines(self) -> list[int]:
        """Start every engine that died or hangs (:mod:`.engine_health`: no answer to a health
        check within ``config.call_timeout_s``) anew on its bundles: its actors killed, new
        ones with an engine holding the checkpoint's weights, given the refit info again; a
        broadcast refit group is formed anew at the next refit. The caller then refits the
        engines and redoes what the dead ones were doing.

        Returns:
            The restarted replicas (empty when every engine is alive and answers).

        Raises:
            EngineFault: an engine died or hung once more than ``config.max_engine_restarts``
                allows (its actors are killed), or its new actors or engine did not start
                (e.g. its node is gone).
        """
        tp = self.layout.tensor_parallel_size
        unanswered, self._unanswered = self._unanswered, {}
        dead = dead_replicas(
            self.worker_group.workers, tp, self.config.call_timeout_s,
            "policy.generation.call_timeout_s", unanswered,
        )
        for replica, reason in sorted(dead.items()):
            self._restart(replica, reason)
        return sorted(dead)

    def _restart(self, replica: int, reason: str) -> None:
        ranks = self.layout.engine_bundles(replica)
        limit = self.config.max_engine_restarts
        what = f"{self.engine_name(replica)} {reason}"
        if self.engine_restarts[replica] >= limit:
            # a hung engine would hold its devices (and the shut-down's wait) until killed
            kill_actors([self.worker_group.workers[r] for r in ranks])
            raise EngineFault(
                f"{what}; it was restarted {limit} time(s) already "
                f"(policy.generation.max_engine_restarts={limit})"
            )
        self.engine_restarts[replica] += 1
        logger.warning(
            "%s; restarting it (restart %d of at most %d)",
            what, self.engine_restarts[replica], limit,
        )
        started = time.monotonic()
        try:
            self.worker_group.replace_workers(ranks, self.config.startup_timeout_s)
            self.engines[replica] = self.worker_group.workers[ranks[0]]
            self._start_engines([replica])
            if self.refit_info is not None:
                self._wait(
                    [(replica, self.engines[replica].refit.remote(
                        "prepare_refit_info", self.refit_info
                    ))],
                    "refit verb prepare_refit_info", self.config.startup_timeout_s,
                    "policy.generation.startup_timeout_s",
                )
        except Exception as err:  # noqa: BLE001 - any failure to come back ends the run
            raise EngineFault(f"{what} and could not be restarted: {error_line(err)}") from err
        # the broadcast group held the dead engine: every member joins a new one
        self.refit_group = None
        logger.warning(
            "vLLM engine %d restarted in %.1f s", replica, time.monotonic() - started
        )

    # ------------------------------------------------------------------ weight refit
    # The whole sequence is nemo_rl.models.generation.refit.refit_policy_generation.

    def refit(self, verb: str, *args: Any) -> list[ray.ObjectRef]:
        """Run one verb of the weight-sync protocol
        (:class:`~nemo_rl.models.generation.refit.interfaces.WeightReceiver`) on every engine,
        without waiting; one future per engine (the caller bounds its wait)."""
        return [engine.refit.remote(verb, *args) for engine in self.engines]

    def prepare_refit_info(self, info: RefitInfo) -> None:
        """Give every engine the policy's ``{hf_name: (shape, dtype)}`` and remember it.

        Raises:
            RefitError: the info does not match the engines' checkpoint.
            EngineTimeout: an engine gave no answer within ``config.call_timeout_s``.
        """
        self._call_engines("refit", "prepare_refit_info", info)
        self.refit_info = dict(info)

    def init_collective(
        self, ip: str, port: int, world_size: int, timeout_s: float
    ) -> list[ray.ObjectRef]:
        """Have engine ``r`` join the refit group at ``ip:port`` as rank ``r + 1`` (the
        trainer is rank 0); returns one future per engine.

        Raises:
            ValueError: ``world_size`` is not 1 + the number of engines.
        """
        if world_size != 1 + self.num_replicas:
            raise ValueError(
                f"world_size={world_size}, but the refit group is the trainer plus "
                f"{self.num_replicas} engines: use {1 + self.num_replicas}"
            )
        self.refit_group = (ip, port, world_size)
        return [
            worker.refit.remote("init_collective", ip, port, world_size, rank + 1, timeout_s)
            for rank, worker in enumerate(self.engines)
        ]

    def close_collective(self) -> None:
        """Have every engine leave the refit group (each within ``config.call_timeout_s``)."""
        self.refit_group = None
        self._call_engines("refit", "close_collective")

    def weight_version(self) -> int:
        """The engines' weight version (committed refits; 0: the checkpoint).

        Raises:
            RuntimeError: the engines hold different versions.
            EngineTimeout: an engine gave no answer within ``config.call_timeout_s``.
        """
        versions = self._call_engines("report_weight_version")
        if len(set(versions)) != 1:
            raise RuntimeError(f"the engines hold different weight versions: {versions}")
        return versions[0]


def _validate_batch(data: BatchedDataDict[Any]) -> int:
    """Check a GenerationDatumSpec batch; returns its size (rows)."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise ValueError(
                f"generate() needs '{key}'; got keys {sorted(data.keys())} (see "
                "GenerationDatumSpec)"
            )
    ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point():
        raise ValueError("'input_ids' must be an integer tensor [batch, seq] of token ids")
    if not isinstance(lengths, torch.Tensor) or lengths.ndim != 1 or lengths.is_floating_point():
        raise ValueError("'input_lengths' must be an integer tensor [batch] (tokens)")
    size = data.size
    if size == 0:
        raise ValueError("generate() got an empty batch; give at least one prompt")
    bad = [i for i, n in enumerate(lengths.tolist()) if not 1 <= n <= ids.shape[1]]
    if bad:
        raise ValueError(
            f"'input_lengths' of rows {bad} are outside [1, {ids.shape[1]}] (the width of "
            "'input_ids'); each must count the real prompt tokens"
        )
    stops = data.get("stop_strings")
    if stops is not None and not all(
        s is None or (isinstance(s, list) and all(isinstance(x, str) for x in s)) for s in stops
    ):
        raise ValueError("'stop_strings' must hold, per row, a list of str or None")
    return size


def _chunk_sizes(size: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``size`` rows, larger first, differing by <= 1."""
    base, extra = divmod(size, parts)
    return [base + (1 if p < extra else 0) for p in range(parts)]


def _request_seed(seed: int, *key: int) -> int:
    """A 63-bit seed for the request named ``key`` under base ``seed``: ``(step, row)`` for
    row ``row`` of generate call ``step``."""
    digest = hashlib.blake2b(":".join(map(str, (seed, *key))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
