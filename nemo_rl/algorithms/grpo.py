"""GRPO: sample groups of responses per prompt, score them, and train on group-relative advantages.

One step is :func:`~nemo_rl.algorithms.grpo_step.step.grpo_step` (generate, advantages,
logprobs, train, refit) over a batch store:
:class:`~nemo_rl.algorithms.grpo_step.in_memory.InMemoryBatchStore` (batches pass through the
driver) or, with ``data_plane.enabled``,
:class:`~nemo_rl.algorithms.grpo_step.data_plane.DataPlaneBatchStore` (the driver carries keys;
rollouts write to the data plane and policy workers read their shards from it).

:func:`setup` builds everything from a :class:`~nemo_rl.algorithms.grpo_config.GRPOMasterConfig`
(the bring-up every rollout-trained run shares is :mod:`nemo_rl.algorithms.rollout_run`'s)
and :func:`grpo_train` runs the loop (after the optional SFT warm start) with validation and
checkpoints; :func:`run` is the ``nemo-rl grpo`` entry point.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import threading
from pathlib import Path
from typing import Any

from nemo_rl.algorithms import rollout_run, training_loop
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.async_grpo import (
    AsyncRollouts,
    LockedPolicy,
    ResumeCursor,
)
from nemo_rl.algorithms.grpo_step.components import GRPOComponents, uses_reference_policy
from nemo_rl.algorithms.grpo_step.data_plane import DataPlaneBatchStore
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.interfaces import BatchStore
from nemo_rl.algorithms.grpo_step.step import generate_groups, grpo_step, validate
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.algorithms.rollout_inputs import load_run_inputs
from nemo_rl.algorithms.sft import run_sft_steps
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.refit import refit_policy_generation

# Folder (under checkpointing.checkpoint_dir) of the SFT warm start's policy: the reference policy
# of a warm-started run, reloaded on resume.
SFT_WARMUP_DIR = "sft_warmup"


def setup(cfg: GRPOMasterConfig) -> GRPOComponents:
    """Data, Ray, clusters, policy, generation engines, environments, loss, logger and
    checkpoints of a run (:func:`~nemo_rl.algorithms.rollout_run.start_rollout_run`), the SFT
    warm start's data; resumes from the latest checkpoint when checkpointing is enabled.

    Raises:
        ConfigError: before anything starts, when the latest checkpoint was trained on another
            model or data than ``cfg`` names (:func:`~nemo_rl.utils.run_config.check_resume`).
    """
    from nemo_rl.data.dataloader import StatefulPromptLoader
    from nemo_rl.data.datasets import (
        check_prompt_lengths,
        setup_demonstration_dataset,
        setup_synthetic_sft_dataset,
    )
    from nemo_rl.utils.timer import Timer

    checkpointer = training_loop.open_checkpointer(cfg)
    inputs = load_run_inputs(cfg)
    sft_loader = None
    if cfg.sft_warmup.enabled:
        warmup = cfg.sft_warmup
        sft_set = (
            setup_synthetic_sft_dataset(cfg.data, inputs.tokenizer, warmup.num_samples)
            if warmup.train_path is None
            else setup_demonstration_dataset(
                cfg.data, warmup.train_path, inputs.tokenizer, warmup.response_key
            )
        )
        check_prompt_lengths(sft_set, cfg.policy.max_total_sequence_length)
        sft_loader = StatefulPromptLoader(
            sft_set, cfg.sft_warmup.global_batch_size, seed=cfg.grpo.seed, shuffle=True
        )
    policy_factory = None
    if cfg.data_plane.enabled:
        from nemo_rl.models.policy.tq_policy import TQPolicy

        policy_factory = functools.partial(TQPolicy, dp_cfg=cfg.data_plane)
    parts, _ = rollout_run.start_rollout_run(
        cfg, inputs, uses_reference_policy(cfg), policy_factory=policy_factory
    )
    return GRPOComponents(
        cfg=cfg,
        loss_fn=ClippedPGLossFn(cfg.loss_fn),
        checkpointer=checkpointer,
        timer=Timer(),
        sft_loader=sft_loader,
        **parts,
    )


def restore_checkpoint(components: GRPOComponents) -> int:
    """Resume from the checkpoint the manager picks
    (:func:`~nemo_rl.algorithms.training_loop.restore_checkpoint`), first rebuilding the reference
    policy of a warm-started run from its SFT warm start's weights; returns the step (0
    without a checkpoint).

    Raises:
        CheckpointError: ``checkpointing.resume_from`` names a missing or damaged checkpoint,
            or the SFT warm start's folder of a warm-started run is damaged.
    """

    def reload_warm_reference(latest: Path) -> None:
        from nemo_rl.utils.checkpoint import CheckpointError
        from nemo_rl.utils.checkpoint_manifest import verify_folder

        if components.sft_loader is None or not uses_reference_policy(components.cfg):
            return
        warm = Path(components.cfg.checkpointing.checkpoint_dir) / SFT_WARMUP_DIR
        if not warm.is_dir():
            raise FileNotFoundError(
                f"{latest} follows an SFT warm start but {warm} (the warm-started weights, the "
                "run's reference policy) is missing; restore it, or start a new run in an "
                "empty checkpointing.checkpoint_dir"
            )
        problem = verify_folder(warm, components.cfg.checkpointing.verify_on_resume)
        if problem is not None:
            raise CheckpointError(
                f"{warm} (the warm-started weights, the run's reference policy) is damaged: "
                f"{problem}; restore it, or start a new run in an empty "
                "checkpointing.checkpoint_dir"
            )
        components.policy.load_checkpoint(str(warm))
        components.policy.snapshot_reference_policy()

    return rollout_run.restore_rollout_checkpoint(components, reload_warm_reference)


def sft_warm_start(components: GRPOComponents) -> None:
    """Run the SFT warm start with its own learning-rate schedule, make the warm-started
    weights the reference policy (the KL penalty anchors to them, not to the random model) and,
    with checkpointing, save them to ``checkpoint_dir/sft_warmup`` so a resumed run can rebuild
    the same reference; then restart the optimizer for GRPO (zero Adam state, the policy's
    schedule from step 0)."""
    from nemo_rl.utils.checkpoint_manifest import fsync_path, seal_folder

    cfg, warm = components.cfg, components.cfg.sft_warmup
    components.policy.reset_optimizer(warm.lr_schedule())
    losses = run_sft_steps(
        components.policy,
        components.sft_loader,
        warm.num_steps,
        components.pad_token_id,
        warm.log_period,
        warm.global_batch_size,
    )
    components.logger.log_metrics(
        {"first_loss": losses[0], "last_loss": losses[-1], "num_steps": len(losses)},
        0,
        "sft_warmup",
    )
    components.generation_stale = True
    if uses_reference_policy(cfg):
        components.policy.snapshot_reference_policy()
        if components.checkpointer is not None:
            # saved before the restart: megatron cannot load an Adam state at step 0
            final = Path(cfg.checkpointing.checkpoint_dir) / SFT_WARMUP_DIR
            tmp = final.with_name(final.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)
            components.policy.save_checkpoint(str(tmp))
            seal_folder(tmp)
            tmp.rename(final)
            fsync_path(final.parent)
    components.policy.reset_optimizer()


def open_batch_store(components: GRPOComponents) -> BatchStore[Any]:
    """The run's batch store: the data plane with ``data_plane.enabled`` (starts its rollout
    actor), else driver memory. :meth:`~BatchStore.close` it after the run."""
    runner = components.rollout_runner()
    if components.cfg.data_plane.enabled:
        return DataPlaneBatchStore(runner, components.policy, components.timer)
    return InMemoryBatchStore(runner, components.policy)


def grpo_train(components: GRPOComponents) -> dict[str, float]:
    """Run GRPO from the resumed checkpoint (or step 0, after the optional SFT warm start) to
    ``grpo.max_num_steps`` in the shared :func:`~nemo_rl.algorithms.training_loop.train_loop`,
    through the batch store of :func:`open_batch_store`.

    A stop signal or ``checkpointing.checkpoint_must_save_by`` ends the loop early by the rule
    of :mod:`nemo_rl.utils.run_stop`: the finished step is saved (with checkpointing), then
    :class:`~nemo_rl.utils.run_stop.RunStopped` (exit code 75; 128 + the signal without
    checkpointing) is raised.

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).
    """
    parts = rollout_run.loop_parts(components)
    with training_loop.stop_guard(parts) as guard:
        step = restore_checkpoint(components)
        if step == 0 and components.sft_loader is not None:
            sft_warm_start(components)
        if components.cfg.grpo.async_grpo.enabled:
            return train_async(components, guard, step)
        store = open_batch_store(components)
        try:
            return training_loop.train_loop(
                parts,
                guard,
                step,
                step_fn=lambda batches: grpo_step(components, store, batches),
                validate_fn=(lambda: validate(components, store)) if components.val_batches else None,
                extra_info=lambda metrics: rollout_run.checkpoint_info(components, metrics),
            )
        finally:
            store.close()


def train_async(components: GRPOComponents, guard: Any, step: int) -> dict[str, float]:
    """:func:`grpo_train`'s loop with ``grpo.async_grpo.enabled``: the same step over a
    collector that generates ahead (:mod:`~nemo_rl.algorithms.grpo_step.async_grpo`).

    From here on the policy is used under one lock (:class:`LockedPolicy`); checkpoints save
    the loader position and sampling step of the first batch not yet trained on (the buffer is
    drained by that rule, not saved); validation has the engines to itself, refit to the
    latest weights.
    """
    lock = threading.RLock()
    components.policy = LockedPolicy(components.policy, lock)
    store = open_batch_store(components)
    generation = components.generation

    def roll_out(prompts: BatchedDataDict) -> tuple[Any, Any]:
        generation.prepare_for_generation()  # the collector has refit the engines already
        return generate_groups(components, store, prompts)

    source = AsyncRollouts(
        roll_out,
        refit=lambda: refit_policy_generation(components.policy, generation, colocated=False),
        loader=components.train_loader,
        sampling_step=lambda: generation.sampling_step,
        cfg=components.cfg.grpo.async_grpo,
        start_step=step,
        engines_current=not components.generation_stale,
        policy_lock=lock,
    )
    components.generation_stale = False  # the source refits from here on
    parts = dataclasses.replace(
        rollout_run.loop_parts(components), train_loader=ResumeCursor(source)
    )

    def validate_async() -> dict[str, float]:
        with source.engines():
            return validate(components, store)

    def extra_info(metrics: dict[str, float]) -> dict[str, Any]:
        return {
            **rollout_run.checkpoint_info(components, metrics),
            "generation_sampling_step": source.resume_point()[1],
        }

    try:
        return training_loop.train_loop(
            parts,
            guard,
            step,
            step_fn=lambda batches: grpo_step(components, store, batches, source),
            validate_fn=validate_async if components.val_batches else None,
            extra_info=extra_info,
        )
    finally:
        source.close()
        store.close()


def run(cfg: GRPOMasterConfig) -> int | None:
    """``nemo-rl grpo``: set up, train, print where logs and checkpoints are, shut down.

    Returns:
        None when the run finished; 75 (:data:`~nemo_rl.utils.run_stop.RESUMABLE_EXIT_CODE`)
        when it saved and stopped early (a stop signal, ``checkpoint_must_save_by``); 128 + the
        signal number when a stop signal ended it without checkpointing (nothing saved).
    """
    components = setup(cfg)
    return rollout_run.run_rollout_command(
        components,
        lambda: grpo_train(components),
        lambda: rollout_run.shutdown(components),
        (("train", "reward"), ("validation", "accuracy")),
    )
