"""The driver-side policy: one object the algorithm loop calls, backed by Megatron workers.

``Policy`` validates the parallel layout, starts one :class:`MegatronPolicyWorker` per rank on a
:class:`RayVirtualCluster`, shards each ``BatchedDataDict`` over data-parallel replicas (with the
micro-batch plan of dynamic batching or sequence packing when enabled), and puts results back
in the caller's row order. Weights never pass through the driver.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import ray
import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict, ShardedBatch
from nemo_rl.distributed.shard_planner import DynamicBatchingArgs, SequencePackingArgs
from nemo_rl.distributed.worker_groups import RayWorkerGroup
from nemo_rl.models.policy.interfaces import (
    ColocatablePolicyInterface,
    LogprobOutputSpec,
    ReferenceLogprobOutputSpec,
)
from nemo_rl.models.policy.parallel_layout import ParallelLayout, plan_parallel_layout
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker
from nemo_rl.models.model_path import resolve_model_path

if TYPE_CHECKING:
    from nemo_rl.algorithms.loss.interfaces import LossFunction
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.generation.refit.interfaces import RefitInfo
    from nemo_rl.models.generation.refit.ipc import IpcStream
    from nemo_rl.models.policy.config import PolicyConfig

# Sequence dimension that dynamic batching / packing plan over (token ids and their lengths).
_INPUT_KEY = "input_ids"
_LENGTHS_KEY = "input_lengths"


class Policy(ColocatablePolicyInterface):
    """Megatron-Core policy spread over the bundles of ``cluster``.

    Args:
        cluster: where the workers go; every bundle gets one rank.
        config: the validated ``policy`` section.
        init_reference_model: keep the initial weights as the reference policy (for the KL
            penalty and ``get_reference_policy_logprobs``).
        seed: model-parallel RNG seed of the workers.
        init_optimizer: False: frozen workers that only score (a distillation teacher): no
            optimizer, scheduler or gradient buffers; ``train`` and the checkpoint verbs raise.
        name: what its workers are called in fault messages (``"teacher"``: "teacher worker
            rank 0 on ... died during get_topk_logits").

    Every wait for the workers is bounded by ``config.call_timeout_s`` and reports a dead,
    hung or failed rank in one line (:mod:`nemo_rl.distributed.worker_faults`).
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: PolicyConfig,
        init_reference_model: bool = True,
        seed: int = 42,
        init_optimizer: bool = True,
        name: str = "policy",
    ) -> None:
        self.cfg = config
        self.model_path = resolve_model_path(config.model_name, field=f"{name}.model_name")
        self.layout: ParallelLayout = plan_parallel_layout(
            config, self.model_path, cluster.world_size()
        )
        # The refit group rank 0 joined ((ip, port, world_size)) and the refit info (see the
        # refit section below).
        self.refit_group: Optional[tuple[str, int, int]] = None
        self._refit_info: Optional[RefitInfo] = None
        self.worker_group = RayWorkerGroup(
            cluster,
            ray.remote(MegatronPolicyWorker),
            self.layout.axes(),
            actor_kwargs={
                "config": config,
                "model_path": self.model_path,
                "init_reference_model": init_reference_model,
                "seed": seed,
                "init_optimizer": init_optimizer,
            },
            name=name,
        )

    # ---- sharding ------------------------------------------------------------------------

    def _shard(
        self, data: BatchedDataDict, stage: str, batch_size: Optional[int] = None
    ) -> ShardedBatch:
        """Split ``data`` into one shard per DP replica.

        Args:
            stage: "train" or "logprob": selects the token budget of dynamic batching/packing.
            batch_size: global batch per optimizer step (train) or None (the whole batch).
        """
        packing, dynamic = self._packing_args(f"{stage}_mb_tokens")
        return data.shard_by_batch_size(
            self.layout.dp,
            batch_size=batch_size,
            sequence_packing_args=packing,
            dynamic_batching_args=dynamic,
        )

    def _packing_args(
        self, mb_tokens_key: str
    ) -> tuple[Optional[SequencePackingArgs], Optional[DynamicBatchingArgs]]:
        """``(sequence_packing_args, dynamic_batching_args)`` of a stage, at most one set.

        Args:
            mb_tokens_key: the stage's token-budget field, "train_mb_tokens" or
                "logprob_mb_tokens".
        """
        packing, dynamic = self.cfg.sequence_packing, self.cfg.dynamic_batching
        if packing.enabled:
            return SequencePackingArgs(
                input_key=_INPUT_KEY,
                input_lengths_key=_LENGTHS_KEY,
                max_tokens_per_microbatch=getattr(packing, mb_tokens_key),
                algorithm=packing.algorithm,
                # the worker pads every packed sample to a multiple of 2 * CP tokens
                sequence_length_round=2 * self.layout.cp,
            ), None
        if dynamic.enabled:
            return None, DynamicBatchingArgs(
                input_key=_INPUT_KEY,
                input_lengths_key=_LENGTHS_KEY,
                max_tokens_per_microbatch=getattr(dynamic, mb_tokens_key),
                sequence_length_round=dynamic.sequence_length_round,
            )
        return None, None

    def _results(self, futures: list[ray.ObjectRef]) -> list[Any]:
        """The workers' results of one call, waiting at most ``policy.call_timeout_s``."""
        return self.worker_group.get_all_worker_results(
            futures, self.cfg.call_timeout_s, "policy.call_timeout_s"
        )

    def _run_sharded(
        self, method: str, shards: list[BatchedDataDict], **common_kwargs: Any
    ) -> list[Any]:
        futures = self.worker_group.run_all_workers_sharded_data(
            method, shards, common_kwargs=common_kwargs
        )
        return self._results(futures)

    def _logprob_pass(self, data: BatchedDataDict, method: str, **kwargs: Any) -> BatchedDataDict:
        check_batch(data, f"Policy.{method}")
        sharded = self._shard(data, "logprob")
        outputs = self._run_sharded(
            method, sharded.shards, micro_batch_size=self.cfg.logprob_batch_size, **kwargs
        )
        return BatchedDataDict.from_batches(outputs).reorder_data(sharded.sorted_indices)

    # ---- PolicyInterface -----------------------------------------------------------------

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict[LogprobOutputSpec]:
        """``logprobs`` [batch, seq] of ``data["input_ids"]`` in ``data``'s row order."""
        return self._logprob_pass(data, "get_logprobs")

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]:
        """``reference_logprobs`` [batch, seq] under the initial weights, in row order."""
        return self._logprob_pass(data, "get_reference_policy_logprobs")

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0
    ) -> BatchedDataDict:
        """``topk_logits`` (log-probabilities at ``temperature``) and ``topk_indices`` of the
        ``k`` most probable tokens at every position, ``[batch, seq, k]`` each, in ``data``'s
        row order: what a distillation teacher sends (never ``[batch, seq, vocab]``)."""
        return self._logprob_pass(data, "get_topk_logits", k=k, temperature=temperature)

    def get_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """``values`` [batch, seq] of a critic (``reward_model_cfg.enabled``): the scalar
        head's value of the state before each token, in ``data``'s row order."""
        return self._logprob_pass(data, "get_values")

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: Optional[int] = None,
        mbs: Optional[int] = None,
    ) -> dict[str, Any]:
        """One optimizer step per ``gbs`` samples of ``data``; returns aggregated metrics.

        Returns:
            See :func:`aggregate_train_results`.
        """
        check_batch(data, "Policy.train")
        gbs = check_global_batch(data.size, gbs, self.cfg, self.layout.dp)
        mbs = mbs if mbs is not None else self.cfg.train_micro_batch_size
        shards = self._shard(data, "train", batch_size=gbs).shards
        results = self._run_sharded(
            "train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
        )
        return aggregate_train_results(results)

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self._results(
            self.worker_group.run_all_workers_single_data("prepare_for_training")
        )

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the Megatron workers reuse their training buffers in place for
        scoring, so ending a training phase needs no call to them (a Ray round trip per
        step saved)."""

    def snapshot_reference_policy(self) -> None:
        """Make the current weights the reference policy on every worker (the KL penalty's
        anchor), e.g. after an SFT warm start."""
        self._results(
            self.worker_group.run_all_workers_single_data("snapshot_reference_policy")
        )

    def reset_optimizer(self, lr_schedule: dict[str, Any] | None = None) -> None:
        """Zero the optimizer state and restart the learning-rate schedule on every worker
        (keys of ``lr_schedule`` replace the configured ``lr``, ``min_lr`` and scheduler
        fields), e.g. to give an SFT warm start and the RL run after it separate optimizers."""
        self._results(
            self.worker_group.run_all_workers_single_data("reset_optimizer", lr_schedule)
        )

    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, scheduler, RNG and step to ``path`` (a dist checkpoint)."""
        self._results(
            self.worker_group.run_all_workers_single_data("save_checkpoint", path)
        )

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (possibly at another TP/PP layout)."""
        self._results(
            self.worker_group.run_all_workers_single_data("load_checkpoint", path)
        )

    def shutdown(self) -> bool:
        return self.worker_group.shutdown(cleanup_method="shutdown")

    # ---- refit ---------------------------------------------------------------------------
    # The verbs of nemo_rl.models.generation.refit.interfaces.WeightSender, run on every rank
    # (the export is collective over each replica's TP/PP/EP ranks). Bucket size, export
    # dtype, timeout and checksums come from the config (PolicyConfig.refit_settings). The
    # whole sequence is nemo_rl.models.generation.refit.refit_policy_generation.

    def refit(self, verb: str, *args: Any) -> list[ray.ObjectRef]:
        """``verb`` on every rank, without waiting; one future per rank, in rank order."""
        return self.worker_group.run_all_workers_single_data("refit", verb, *args)

    def _refit_results(self, verb: str, *args: Any) -> list[Any]:
        """``verb`` on every rank; every rank's result, in rank order, once all finished."""
        return self._results(self.refit(verb, *args))

    def prepare_refit_info(self) -> Optional[dict[str, Any]]:
        """``{hf_name: (shape, dtype)}`` of the weights a refit sends, in export order, in the
        engines' precision (``generation.vllm_cfg.precision``). Exported once, then cached."""
        if self._refit_info is None:
            self._refit_info = self._refit_results("prepare_refit_info")[0]
        return self._refit_info

    def prepare_weights_for_ipc(self, readers: Mapping[int, int]) -> dict[int, IpcStream]:
        """Open a colocated refit stream on every rank.

        Args:
            readers: ``{writer rank: readers of its ring}``, the refit plan's rings
                (``refit.orchestrate.colocated_plan``).

        Returns:
            ``{writer rank: IpcStream}``: each writer's ring handle (never the bytes), the
            stream's version, bucket size and plan (the tensor names per bucket).
        """
        opened = self._refit_results("prepare_weights_for_ipc", dict(readers))
        return {rank: stream for rank, stream in enumerate(opened) if stream is not None}

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any]:
        """Export the buckets of the open stream carrying ``keys`` (whole buckets of its plan,
        in order) and have the writers pack them into their rings, each once its slot is free
        (engines must be loading meanwhile); ``{"writers": {rank: timings (s)}}``."""
        results = self._refit_results("get_weights_ipc_handles", keys)
        return {"writers": {rank: r for rank, r in enumerate(results) if r is not None}}

    def finish_weights_ipc(self) -> None:
        """End the colocated stream on every rank, once the engines are done with it."""
        self._refit_results("finish_weights_ipc")

    def refit_collective_address(self) -> tuple[str, int]:
        """Address of rank 0's node and a port free there, for :meth:`init_collective`."""
        return self.worker_group.cluster.get_master_address_and_port()

    def init_collective(self, ip: str, port: int, world_size: int) -> list[ray.ObjectRef]:
        """Rank 0 joins the refit group (as its rank 0, with the engines); one future per
        rank. Wait for them together with the engines' ``init_collective``."""
        self.refit_group = (ip, port, world_size)
        return self.refit("init_collective", ip, port, world_size)

    def broadcast_weights_for_collective(self) -> list[ray.ObjectRef]:
        """Broadcast every weight over the refit group; one future per rank (rank 0's
        resolves to its timings). Wait for them together with the engines' receives."""
        return self.refit("broadcast_weights_for_collective")

    def close_collective(self) -> None:
        """Rank 0 leaves the refit group."""
        self.refit_group = None
        self._refit_results("close_collective")

    def offload_before_refit(self) -> None:
        """Optimizer state and gradients off the device before the engines wake up."""
        self._results(
            self.worker_group.run_all_workers_single_data("offload_before_refit")
        )

    def offload_after_refit(self) -> None:
        """Parameters off the device once the engines hold the new weights."""
        self._results(
            self.worker_group.run_all_workers_single_data("offload_after_refit")
        )


def check_batch(data: BatchedDataDict, caller: str) -> None:
    """Check the fields every policy call reads: ``input_ids`` ``[batch, seq]`` integer and
    ``input_lengths`` ``[batch]`` (tokens of each row, 1..seq).

    Raises:
        ValueError: a field is missing or malformed, naming it and what it should be.
    """
    ids = data.get("input_ids") if hasattr(data, "get") else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        got = "no such key" if ids is None else type(ids).__name__
        if isinstance(ids, torch.Tensor):
            got = f"{ids.dtype} {list(ids.shape)}"
        raise ValueError(
            f"{caller} needs data['input_ids']: an integer tensor [batch, seq] of right-padded "
            f"token ids, got {got}"
        )
    lengths = data.get("input_lengths")
    if lengths is None:
        raise ValueError(
            f"{caller} needs data['input_lengths']: a [batch] integer tensor with the tokens of "
            "each row (e.g. (input_ids != pad_token_id).sum(1) for right padding)"
        )
    if not isinstance(lengths, torch.Tensor) or lengths.shape != ids.shape[:1]:
        raise ValueError(
            f"{caller}: data['input_lengths'] must be a tensor [batch] = [{ids.shape[0]}], got "
            f"{list(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__}"
        )
    if len(lengths) and (int(lengths.min()) < 1 or int(lengths.max()) > ids.shape[1]):
        raise ValueError(
            f"{caller}: data['input_lengths'] must lie in [1, {ids.shape[1]}] (the columns of "
            f"input_ids), got {int(lengths.min())}..{int(lengths.max())}"
        )


def check_global_batch(size: int, gbs: Optional[int], cfg: PolicyConfig, dp: int) -> int:
    """The global batch size ``gbs`` stands for (None: ``cfg.train_global_batch_size``),
    checked: ``size`` samples train as whole global batches of it, split over ``dp`` replicas.

    Raises:
        ValueError: naming the size and where it came from (the argument or the config).
    """
    source = "the gbs argument" if gbs is not None else "policy.train_global_batch_size"
    gbs = gbs if gbs is not None else cfg.train_global_batch_size
    if size % gbs:
        raise ValueError(
            f"Policy.train: the batch has {size} samples, not a multiple of the global batch "
            f"size {gbs} ({source}): pass a gbs that divides {size}, or whole global batches"
        )
    if gbs % dp and not cfg.sequence_packing.enabled:
        raise ValueError(
            f"Policy.train: the global batch size {gbs} ({source}) does not split over the "
            f"{dp} data-parallel replicas: use a multiple of {dp}"
        )
    return gbs


def aggregate_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One train result from the per-DP-replica results of ``MegatronPolicyWorker.train``.

    The workers already reduce over data parallelism (loss and metrics are all-reduced before
    they return), so every replica reports the same global figures; this checks that they do
    and adds up the micro-batch counts.

    Returns:
        Lists with one entry per optimizer step: ``loss`` (global loss), ``grad_norm`` (before
        clipping; None in eval mode), ``lr``, ``num_micro_batches`` (over all replicas), and
        ``metrics``: name -> per-step values summed over micro-batches and replicas.

    Raises:
        RuntimeError: the replicas disagree on the loss (their collectives went out of step).
    """
    first = results[0]
    for index, other in enumerate(results[1:], start=1):
        if other["loss"] != first["loss"]:
            raise RuntimeError(
                f"data-parallel replicas disagree on the global loss: replica 0 {first['loss']}, "
                f"replica {index} {other['loss']}"
            )
    return {
        "loss": first["loss"],
        "grad_norm": first["grad_norm"],
        "lr": first["lr"],
        "metrics": first["metrics"],
        "num_micro_batches": [sum(steps) for steps in zip(*(r["num_micro_batches"] for r in results))],
    }
