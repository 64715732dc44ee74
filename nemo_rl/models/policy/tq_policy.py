"""TQPolicy: the policy driven by :class:`KVBatchMeta` instead of tensors (the data-plane path).

Counterpart of :class:`~nemo_rl.models.policy.lm_policy.Policy` for the batch store of
:mod:`nemo_rl.algorithms.grpo_step.data_plane`, over either data-plane backend its workers can
reach (``data_plane.backend``: "ray_object_store" or "transfer_queue"); the name is NeMo RL's,
from its TransferQueue ("TQ") version. A step's samples are written to the data plane once,
under keys minted by :class:`~nemo_rl.experience.sync_rollout_actor.SyncRolloutActor`; the
driver holds the meta. Each dispatch cuts the meta per DP replica with
:func:`~nemo_rl.data_plane.preshard.shard_meta_for_dp` (the decisions ``shard_by_batch_size``
makes in memory), every rank fetches its replica's keys from the store, and for logprobs the
replica leader writes the result back under the same keys (the Ray return is None).

Fields of a training step (token fields as right-padded rows, sample fields 0-dim; see
:mod:`nemo_rl.data_plane.columns`):

================================  ===========================  ==============================
field                             written by                   kind
================================  ===========================  ==============================
``input_ids``                     rollout actor                token (padded with pad_token_id)
``token_mask``                    rollout actor                token (1 on assistant tokens)
``generation_logprobs``           rollout actor                token
``input_lengths``                 rollout actor                sample
``advantages``, ``sample_mask``   driver (from the carry)      sample
``prev_logprobs``                 workers (replica leaders)    token
``reference_policy_logprobs``     workers (replica leaders)    token
================================  ===========================  ==============================

The partition lifecycle is the trainer's: :meth:`TQPolicy.prepare_step` opens the training
partition, :meth:`TQPolicy.discard_samples` drops samples mid-step (dynamic sampling) and
:meth:`TQPolicy.finish_step` empties it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Optional

import ray

from nemo_rl.data_plane.columns import read_columns, stamp_pad_seqlen, write_columns
from nemo_rl.data_plane.config import DataPlaneConfig, as_data_plane_config, start_data_plane
from nemo_rl.data_plane.interfaces import DataPlaneClient, DataPlaneError, preview
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.data_plane.preshard import shard_meta_for_dp
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.models.policy.lm_policy import aggregate_train_results as _aggregate_train_results
from nemo_rl.utils.errors import ResumableFault

if TYPE_CHECKING:
    from nemo_rl.algorithms.loss.interfaces import LossFunction
    from nemo_rl.utils.timer import Timer

DP_ROLLOUT_FIELDS = ("input_ids", "input_lengths", "token_mask", "generation_logprobs")
DP_DRIVER_FIELDS = ("advantages", "sample_mask")
PREV_LOGPROBS_FIELD = "prev_logprobs"
REFERENCE_LOGPROBS_FIELD = "reference_policy_logprobs"
# Everything a training step stores per sample (the union of all producers' fields).
DP_TRAIN_FIELDS = (
    *DP_ROLLOUT_FIELDS,
    *DP_DRIVER_FIELDS,
    PREV_LOGPROBS_FIELD,
    REFERENCE_LOGPROBS_FIELD,
)
# What a logprob pass reads: token ids and lengths only.
LP_SEED_FIELDS = ("input_ids", "input_lengths")
TRAIN_PARTITION_ID = "train"
VAL_PARTITION_ID = "val"


class TQPolicy(Policy):
    """A :class:`Policy` whose scoring and training read the data plane.

    Args:
        *args, **kwargs: those of :class:`Policy`.
        dp_cfg: the ``data_plane`` section (a :class:`DataPlaneConfig` or its ``model_dump()``);
            its backend must be reachable from the workers: "ray_object_store" or
            "transfer_queue" (not "in_process").
        tq_partition_id: the training partition (cleared and reused every step; NeMo RL's
            argument name, whatever the backend).

    The constructor starts the store on the driver (this object owns it: :meth:`shutdown`
    stops it) and attaches every worker to it.

    Raises:
        DataPlaneError: ``dp_cfg.backend`` is "in_process", or the store cannot start.
    """

    def __init__(
        self,
        *args: Any,
        dp_cfg: DataPlaneConfig | Mapping[str, Any],
        tq_partition_id: str = TRAIN_PARTITION_ID,
        **kwargs: Any,
    ) -> None:
        self.dp_cfg = as_data_plane_config(dp_cfg)
        if self.dp_cfg.backend == "in_process":
            raise DataPlaneError(
                "TQPolicy needs a data plane its workers can reach, but data_plane.backend is "
                "'in_process' (the driver's memory); set data_plane.backend='transfer_queue' or "
                "'ray_object_store'"
            )
        self.tq_partition_id = tq_partition_id
        super().__init__(*args, **kwargs)
        try:
            self.data_plane: DataPlaneClient = start_data_plane(self.dp_cfg)
        except BaseException:
            super().shutdown()
            raise
        try:
            self._results(
                self.worker_group.run_all_workers_single_data("setup_data_plane", self.dp_cfg)
            )
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> bool:
        """Close the data plane (stopping its actors) before shutting down the workers."""
        self.data_plane.close()
        return super().shutdown()

    # ---- partition lifecycle -------------------------------------------------------------

    def prepare_step(self, num_samples: int, group_size: Optional[int] = None) -> None:
        """Open the training partition for a step of ``num_samples`` samples.

        Args:
            num_samples: samples the step trains on (``prompts x group_size``).
            group_size: GRPO group size (responses per prompt); None: no grouping.

        Raises:
            ValueError: ``num_samples`` < 1 or not a multiple of ``group_size``.
            DataPlaneError: the partition still holds samples of an earlier step.
        """
        if num_samples < 1 or (group_size is not None and num_samples % group_size):
            raise ValueError(
                f"prepare_step needs num_samples >= 1 and a multiple of group_size; got "
                f"num_samples={num_samples}, group_size={group_size}"
            )
        self.data_plane.register_partition(self.tq_partition_id)

    def prepare_val_partition(
        self, num_samples: int, *, partition_id: str = VAL_PARTITION_ID
    ) -> None:
        """Open the validation partition ``partition_id`` for a batch of ``num_samples``.

        Raises:
            ValueError: ``partition_id`` is the training partition, or ``num_samples`` < 1.
        """
        if partition_id == self.tq_partition_id:
            raise ValueError(
                f"the validation partition must differ from the training partition "
                f"{self.tq_partition_id!r}; pass another partition_id"
            )
        if num_samples < 1:
            raise ValueError(f"prepare_val_partition needs num_samples >= 1, got {num_samples}")
        self.data_plane.register_partition(partition_id)

    def discard_samples(self, sample_ids: Sequence[str], partition_id: str) -> None:
        """Drop the samples ``sample_ids`` (all their fields) from ``partition_id``."""
        self.data_plane.clear_samples(partition_id, sample_ids)

    def finish_step(self, meta: KVBatchMeta) -> None:
        """Drop ``meta``'s samples; the partition is then empty (and stays registered).

        Raises:
            DataPlaneError: the partition held samples ``meta`` does not name (minted this
                step but neither trained on nor discarded); they are dropped too.
        """
        self.discard_samples(meta.keys, meta.partition_id)
        leaked = self.data_plane.list_keys(meta.partition_id)
        if leaked:
            self.data_plane.clear_samples(meta.partition_id, leaked)
            raise DataPlaneError(
                f"partition {meta.partition_id!r} held {len(leaked)} samples {preview(leaked)} "
                "besides the step's batch; discard_samples every sample the step drops "
                "(they were dropped now)"
            )

    def abort_partition(self, partition_id: str) -> None:
        """Drop everything in ``partition_id`` and unregister it (after a failed step)."""
        self.data_plane.clear_partition(partition_id)

    # ---- driver-side columns -------------------------------------------------------------

    def _stamp_pad_seqlen(self, meta: KVBatchMeta) -> None:
        """Mint the global forward pad length onto ``meta.extra_info`` (idempotent); shards
        made afterwards inherit it, so every replica pads to the same ``S``."""
        stamp_pad_seqlen(meta)

    def read_from_dataplane(
        self,
        meta: KVBatchMeta,
        *,
        select_fields: Sequence[str],
        pad_value_dict: Optional[Mapping[str, Any]] = None,
    ) -> BatchedDataDict:
        """``select_fields`` of ``meta``'s samples, token fields ``[B, S]`` padded to the global
        forward pad length (the ``S`` the workers use), sample fields ``[B]``."""
        self._stamp_pad_seqlen(meta)
        return read_columns(self.data_plane, meta, select_fields, pad_value_dict)

    def write_to_dataplane(self, meta: KVBatchMeta, fields: Mapping[str, Any]) -> KVBatchMeta:
        """Write driver-computed ``fields`` (``[B]`` sample or ``[B, S]`` token tensors) under
        ``meta``'s keys; returns ``meta`` with them."""
        return write_columns(self.data_plane, meta, fields)

    # ---- dispatch ------------------------------------------------------------------------

    def _shard_meta(
        self, meta: KVBatchMeta, mb_tokens_key: str, batch_size: Optional[int] = None
    ) -> list[KVBatchMeta]:
        self._stamp_pad_seqlen(meta)
        packing, dynamic = self._packing_args(mb_tokens_key)
        return shard_meta_for_dp(
            meta,
            self.layout.dp,
            batch_size=batch_size,
            sequence_packing_args=packing,
            dynamic_batching_args=dynamic,
        )

    def _run_meta_shards(
        self, task_name: str, worker_method: str, shards: list[KVBatchMeta], **kwargs: Any
    ) -> list[Any]:
        """``worker_method(shard, **kwargs)`` on every rank; the replicas' results.

        Raises:
            DataPlaneError: a worker's call failed; names the partition and the failed
                replicas' keys. The partition is cleared first.
            ResumableFault: a worker died, hung or failed a collective
                (:mod:`nemo_rl.distributed.worker_faults`; the same kind, its message naming
                the partition and its keys); the partition is cleared first.
        """
        futures = self.worker_group.run_all_workers_sharded_data(
            worker_method, shards, common_kwargs=kwargs
        )
        try:
            return self._results(futures)
        except ResumableFault as fault:  # a dead or hung rank: the run stops, a rerun resumes
            partition_id = shards[0].partition_id
            keys = [key for shard in shards for key in shard.keys]
            self.abort_partition(partition_id)
            raise type(fault)(
                f"{fault}; {task_name}: partition {partition_id!r} ({len(keys)} keys "
                f"{preview(keys)}) was cleared"
            ) from fault
        except ray.exceptions.RayError as err:
            partition_id = shards[0].partition_id
            failed = [
                key
                for shard, future in zip(shards, futures)
                if _failed(future)
                for key in shard.keys
            ] or [key for shard in shards for key in shard.keys]
            self.abort_partition(partition_id)
            cause = getattr(err, "cause", None) or err
            raise DataPlaneError(
                f"{task_name}: a policy worker failed while fetching or computing its shard of "
                f"partition {partition_id!r} ({len(failed)} keys {preview(failed)}): "
                f"{type(cause).__name__}: {cause}. The partition was cleared; the step cannot "
                "continue"
            ) from err

    def _logprob_dispatch(
        self,
        meta: KVBatchMeta,
        *,
        task_name: str,
        worker_method: str,
        timer_prefix: str,
        timer: Optional[Timer],
        common_kwargs: dict[str, Any],
    ) -> KVBatchMeta:
        """Shared body of the two logprob passes: the workers fetch only ``LP_SEED_FIELDS``,
        compute, and the replica leaders write ``task_name`` (the result field) back.

        Returns:
            ``meta`` with the field ``task_name``.
        """
        self._stamp_pad_seqlen(meta)  # on the step's meta: later passes inherit it
        shards = self._shard_meta(meta.select_fields(LP_SEED_FIELDS), "logprob_mb_tokens")
        with _timed(timer, f"{timer_prefix}/dispatch"):
            self._run_meta_shards(
                task_name, worker_method, shards, result_field=task_name, **common_kwargs
            )
        return meta.with_fields([task_name])

    def get_logprobs_from_meta(
        self,
        meta: KVBatchMeta,
        micro_batch_size: Optional[int] = None,
        timer: Optional[Timer] = None,
    ) -> KVBatchMeta:
        """The policy's logprobs of ``meta``'s samples, stored as ``prev_logprobs``
        (the rows of :meth:`Policy.get_logprobs`); returns ``meta``
        with that field."""
        return self._logprob_dispatch(
            meta,
            task_name=PREV_LOGPROBS_FIELD,
            worker_method="get_logprobs_presharded",
            timer_prefix="policy_logprobs",
            timer=timer,
            common_kwargs={"micro_batch_size": micro_batch_size or self.cfg.logprob_batch_size},
        )

    def get_reference_policy_logprobs_from_meta(
        self,
        meta: KVBatchMeta,
        micro_batch_size: Optional[int] = None,
        timer: Optional[Timer] = None,
    ) -> KVBatchMeta:
        """The reference policy's logprobs, stored as ``reference_policy_logprobs``; returns
        ``meta`` with that field."""
        return self._logprob_dispatch(
            meta,
            task_name=REFERENCE_LOGPROBS_FIELD,
            worker_method="get_reference_policy_logprobs_presharded",
            timer_prefix="reference_logprobs",
            timer=timer,
            common_kwargs={"micro_batch_size": micro_batch_size or self.cfg.logprob_batch_size},
        )

    def train_from_meta(
        self,
        meta: KVBatchMeta,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: Optional[int] = None,
        mbs: Optional[int] = None,
        timer: Optional[Timer] = None,
    ) -> dict[str, Any]:
        """:meth:`Policy.train` on the samples of ``meta``: every rank fetches all of
        ``meta.fields`` for its replica's keys.

        Args:
            meta: the whole step (all fields the loss reads written).
            gbs: global batch size; None: ``policy.train_global_batch_size``.
            mbs: micro-batch size; None: ``policy.train_micro_batch_size``.
            timer: receives ``policy_training/dispatch``.

        Returns:
            See :func:`~nemo_rl.models.policy.lm_policy.aggregate_train_results`.
        """
        gbs = gbs if gbs is not None else self.cfg.train_global_batch_size
        mbs = mbs if mbs is not None else self.cfg.train_micro_batch_size
        shards = self._shard_meta(meta, "train_mb_tokens", batch_size=gbs)
        with _timed(timer, "policy_training/dispatch"):
            results = self._run_meta_shards(
                "train",
                "train_presharded",
                shards,
                loss_fn=loss_fn,
                eval_mode=eval_mode,
                gbs=gbs,
                mbs=mbs,
            )
        return _aggregate_train_results(results)


def _failed(future: ray.ObjectRef) -> bool:
    """Whether ``future`` is ready and raised."""
    ready, _ = ray.wait([future], timeout=0)
    if not ready:
        return False
    try:
        ray.get(future)
    except ray.exceptions.RayError:
        return True
    return False


def _timed(timer: Optional[Timer], name: str) -> AbstractContextManager[None]:
    return timer.time(name) if timer is not None else nullcontext()
