"""``MegatronPolicyWorker``: one rank of a Megatron-Core policy, as a Ray actor.

Wiring only; each concern lives in :mod:`nemo_rl.models.policy.workers.megatron` (the parts
that import megatron-core load on first use, in the worker process: the driver imports this
module to start the actors and never imports megatron-core). The driver
(``lm_policy.Policy``) starts one actor per rank with ``RayWorkerGroup`` (which sets the
rendezvous environment) and calls these methods on every rank, giving each data-parallel
replica its shard.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from megatron_bridge import export_hf_weights
from megatron_bridge.lora_weights import export_lora_weights
from nemo_rl.data_plane.config import DataPlaneConfig, attach_data_plane
from nemo_rl.data_plane.interfaces import DataPlaneClient
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.refit.interfaces import SENDER_VERBS, call_verb
from nemo_rl.models.generation.refit.sender import RefitSender
from megatron_bridge.parallel_state import destroy_megatron_parallel
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.workers import megatron as parts  # megatron-core parts: on first use
from nemo_rl.models.policy.workers.megatron import data_plane_io
from nemo_rl.models.policy.workers.megatron.reference import take_reference
from nemo_rl.utils.fault_injection import process_fault_at


class MegatronPolicyWorker:
    """One TP x PP x CP x DP rank of the policy.

    Args:
        config: the validated ``policy`` section (a :class:`PolicyConfig`; it pickles through Ray).
        model_path: local HF checkpoint folder.
        init_reference_model: keep the initial weights on the CPU as the reference policy
            (under LoRA: the base model, adapters switched off, nothing copied).
        seed: base seed of megatron's model-parallel RNG tracker.
        init_optimizer: False: a frozen worker that only scores (no DDP gradient buffers, no
            optimizer or scheduler); ``train``, ``reset_optimizer`` and the checkpoint verbs
            raise.
    """

    def __init__(
        self,
        config: PolicyConfig,
        model_path: str,
        init_reference_model: bool = True,
        seed: int = 42,
        init_optimizer: bool = True,
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.policy = parts.model_setup.setup_policy_model(config, model_path, seed, init_optimizer)
        self._lora = config.megatron_cfg.peft.enabled
        self.reference = (
            take_reference(self.policy.model.module, self._lora, initial=True)
            if init_reference_model
            else None
        )
        self.step = 0
        self._packing = config.sequence_packing.enabled
        self._host_stash = parts.offload.HostStash()  # pinned buffers, reused by every offload
        self._refit: RefitSender | None = None
        self._data_plane: DataPlaneClient | None = None

    def snapshot_reference_policy(self) -> None:
        """Make the current weights the reference policy (e.g. after an SFT warm start; under
        LoRA a copy of the adapters only)."""
        self.reference = take_reference(self.policy.model.module, self._lora, initial=False)

    def reset_optimizer(self, lr_schedule: Mapping[str, Any] | None = None) -> None:
        """Start the optimizer over from the current weights: zero Adam state and a new
        learning-rate schedule at step 0.

        Args:
            lr_schedule: replaces fields of ``megatron_cfg.optimizer`` (``lr``, ``min_lr``)
                and ``megatron_cfg.scheduler`` (``lr_decay_style``, ``lr_warmup_iters``,
                ``lr_decay_iters``) for this schedule; None: the configured schedule.

        Raises:
            ConfigError: ``lr_schedule`` names a field neither model has, or a bad value.
            RuntimeError: the worker was made with ``init_optimizer=False``.
        """
        parts.model_setup.require_optimizer(self.policy, "reset the optimizer")
        optimizer, scheduler = self.config.megatron_cfg.lr_schedule(lr_schedule or {})
        parts.model_setup.restart_optimizer(self.policy, optimizer, scheduler)

    # ---------------------------------------------------------------- scoring

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``logprobs`` ``[B, S]`` float32 in ``data``'s row order (last PP stage; an empty
        dict on the other stages), under the engines' sampling distribution
        (``policy.generation``'s temperature, top-k, top-p)."""
        return self._logprobs(data, micro_batch_size, reference=False)

    def _logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None, reference: bool
    ) -> BatchedDataDict:
        _fault_point("policy.logprobs")
        mbs = micro_batch_size or self.config.logprob_batch_size
        logprobs = parts.train_step.compute_logprobs(
            self.policy, data, mbs, self._packing, reference
        )
        return BatchedDataDict() if logprobs is None else BatchedDataDict(logprobs=logprobs)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``reference_logprobs`` ``[B, S]`` under the initial weights (as :meth:`get_logprobs`,
        at the sampling temperature without top-k / top-p: NeMo RL's reference distribution).

        Raises:
            RuntimeError: the worker was made with ``init_reference_model=False``.
        """
        if self.reference is None:
            raise RuntimeError(
                "no reference model: create the worker with init_reference_model=True"
            )
        with self.reference.swapped_in(self.policy.model.module):
            out = self._logprobs(data, micro_batch_size, reference=True)
        return BatchedDataDict(reference_logprobs=out["logprobs"]) if "logprobs" in out else out

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``topk_logits`` (log-probabilities at ``temperature``) and ``topk_indices`` of the
        ``k`` most probable tokens at every position, ``[B, S, k]`` each, in ``data``'s row
        order (last PP stage; an empty dict on the others); a distillation teacher's scores."""
        mbs = micro_batch_size or self.config.logprob_batch_size
        out = parts.train_step.compute_topk_logits(self.policy, data, mbs, k, temperature)
        return BatchedDataDict() if out is None else BatchedDataDict(out)

    def get_values(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``values`` ``[B, S]`` float32 in ``data``'s row order: a critic's (a worker built with
        ``reward_model_cfg.enabled``) scalar head at each token's previous position, 0 at
        position 0 and past each row's length (last PP stage; an empty dict on the others)."""
        mbs = micro_batch_size or self.config.logprob_batch_size
        values = parts.train_step.compute_values(self.policy, data, mbs, self._packing)
        return BatchedDataDict() if values is None else BatchedDataDict(values=values)

    # ---------------------------------------------------------------- training

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train on this rank's shard: one optimizer step per global batch of ``gbs`` rows
        (over all DP ranks); ``eval_mode`` only computes loss and metrics.

        Returns:
            Per optimizer step, lists: ``loss`` (global loss), ``grad_norm`` (before
            clipping; None in eval mode), ``lr``; ``metrics``: name -> per-step values summed
            over micro-batches and DP ranks; ``num_micro_batches`` (this rank's, per step).

        Raises:
            RuntimeError: the worker was made with ``init_optimizer=False``.
        """
        parts.model_setup.require_optimizer(self.policy, "train")
        _fault_point("policy.train")
        gbs = gbs or self.config.train_global_batch_size
        mbs = mbs or self.config.train_micro_batch_size
        steps = list(
            parts.train_step.iterate_steps(
                self.policy, data, loss_fn, gbs, mbs, self._packing, eval_mode
            )
        )
        if not eval_mode:
            self.step += len(steps)
        metrics: dict[str, list[float]] = {}
        for step in steps:
            for key, value in step["metrics"].items():
                metrics.setdefault(key, []).append(value)
        return {
            "loss": [s["loss"] for s in steps],
            "grad_norm": [s["grad_norm"] for s in steps],
            "lr": [s["lr"] for s in steps],
            "metrics": metrics,
            "num_micro_batches": [s["num_micro_batches"] for s in steps],
        }

    def get_train_step(self) -> int:
        """Optimizer steps taken (restored by :meth:`load_checkpoint`)."""
        return self.step

    def prepare_for_training(self) -> None:
        """Bring parameters, gradient buffers and optimizer state back to the device."""
        parts.offload.reload_all(self.policy, self._host_stash)

    # ---------------------------------------------------------------- data plane
    # The TQPolicy path: the driver sends each replica a KVBatchMeta shard instead of tensors.

    def setup_data_plane(self, dp_cfg: DataPlaneConfig) -> None:
        """Attach this rank to the data plane the driver started (``data_plane`` config)."""
        self._data_plane = attach_data_plane(dp_cfg)

    def _client(self) -> DataPlaneClient:
        if self._data_plane is None:
            raise RuntimeError("no data plane: call setup_data_plane(dp_cfg) on every rank first")
        return self._data_plane

    def _fetch(self, meta: KVBatchMeta) -> BatchedDataDict:
        """This replica's shard ``meta`` as a batch (see ``data_plane_io.fetch_batch``)."""
        return data_plane_io.fetch_batch(self._client(), meta)

    def _write_back_result_field(
        self, meta: KVBatchMeta, name: str, values: torch.Tensor | None
    ) -> None:
        """The replica leader puts ``values`` ``[B, S]`` as field ``name`` of ``meta``'s keys."""
        data_plane_io.write_back(self._client(), meta, name, values)

    def get_logprobs_presharded(
        self, meta: KVBatchMeta, result_field: str, micro_batch_size: int | None = None
    ) -> None:
        """:meth:`get_logprobs` of the shard ``meta``, written back as ``result_field``."""
        out = self.get_logprobs(self._fetch(meta), micro_batch_size)
        self._write_back_result_field(meta, result_field, out.get("logprobs"))

    def get_reference_policy_logprobs_presharded(
        self, meta: KVBatchMeta, result_field: str, micro_batch_size: int | None = None
    ) -> None:
        """:meth:`get_reference_policy_logprobs` of ``meta``, written back as ``result_field``."""
        out = self.get_reference_policy_logprobs(self._fetch(meta), micro_batch_size)
        self._write_back_result_field(meta, result_field, out.get("reference_logprobs"))

    def train_presharded(
        self,
        meta: KVBatchMeta,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """:meth:`train` on the shard ``meta`` fetched from the data plane."""
        return self.train(self._fetch(meta), loss_fn, eval_mode, gbs, mbs)

    # ---------------------------------------------------------------- memory around refit

    def offload_before_refit(self) -> int:
        """Optimizer state to the CPU, gradient buffers freed; returns the bytes."""
        return parts.offload.offload_optimizer_and_grads(self.policy, self._host_stash)

    def offload_after_refit(self) -> int:
        """Parameters to the CPU; returns the bytes."""
        return parts.offload.offload_params(self.policy, self._host_stash)

    # ---------------------------------------------------------------- weight refit

    def refit(self, verb: str, *args: Any) -> Any:
        """Run one verb of the weight-sync protocol on this rank's
        :class:`~nemo_rl.models.generation.refit.sender.RefitSender` (verbs and arguments:
        :class:`~nemo_rl.models.generation.refit.interfaces.WeightSender`). Every rank is
        called (the export is collective over each replica's TP/PP ranks, and over EP for a
        mixture-of-experts model)."""
        _fault_point("policy.refit", verb=verb)
        if self._refit is None:
            from megatron.core import parallel_state

            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
            policy = self.policy
            # The engines serve the adapters themselves (vllm_cfg.lora_refit: adapter): only
            # the adapters' tensors are streamed; otherwise every weight, adapters merged in.
            export = (
                export_lora_weights
                if self.config.adapter_serving() is not None
                else export_hf_weights
            )
            self._refit = RefitSender(
                lambda dtype: export(policy.model.module, policy.bridge, dtype),
                rank=torch.distributed.get_rank(),
                # The experts' first data-parallel replica: the dense one's (DP x CP rank 0)
                # and, with EP > 1, the EP ranks holding the other experts.
                in_first_replica=parallel_state.get_expert_data_parallel_rank() == 0,
                device=device,
                settings=self.config.refit_settings(),
            )
        return call_verb(self._refit, SENDER_VERBS, verb, *args)

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler, RNG and step into the new folder ``path``, with the
        source model's tokenizer files (an export of it is a complete HF folder)."""
        parts.model_setup.require_optimizer(self.policy, "save a training checkpoint")
        _fault_point("policy.save")
        parts.checkpointing.save_training_checkpoint(self.policy, path, self.step, self.model_path)

    def load_checkpoint(self, path: str) -> None:
        """Restore a :meth:`save_checkpoint` folder (saved at any TP/PP/DP layout)."""
        parts.model_setup.require_optimizer(self.policy, "load a training checkpoint")
        self.step = parts.checkpointing.load_training_checkpoint(self.policy, path)

    def shutdown(self) -> bool:
        """Tear down the process groups; True when done."""
        if self._refit is not None:
            self._refit.close()
        if self._data_plane is not None:
            self._data_plane.close()
        destroy_megatron_parallel()
        return True


def _fault_point(point: str, **context: Any) -> None:
    """Test-only fault injection (:mod:`nemo_rl.utils.fault_injection`): a ``kill`` or
    ``stop`` armed for ``point`` at this worker's rank ends or stops this process here."""
    process_fault_at(point, rank=int(os.environ.get("RANK", "0")), **context)
