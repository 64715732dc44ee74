"""GRPO: sample groups of responses per prompt, score them, and train on group-relative advantages.

One step is :func:`~nemo_rl.algorithms.grpo_step.step.grpo_step` (generate, advantages,
logprobs, train, refit) over a batch store:
:class:`~nemo_rl.algorithms.grpo_step.in_memory.InMemoryBatchStore` (batches pass through the
driver) or, with ``data_plane.enabled``,
:class:`~nemo_rl.algorithms.grpo_step.data_plane.DataPlaneBatchStore` (the driver carries keys;
rollouts write to the data plane and policy workers read their shards from it).

:func:`setup` builds everything from a :class:`~nemo_rl.algorithms.grpo_config.GRPOMasterConfig`
and :func:`grpo_train` runs the loop (after the optional SFT warm start) with validation and
checkpoints; :func:`run` is the ``nemo-rl grpo`` entry point.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_inputs import load_run_inputs
from nemo_rl.algorithms.grpo_step.components import GRPOComponents, uses_reference_policy
from nemo_rl.algorithms.grpo_step.data_plane import DataPlaneBatchStore
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.interfaces import BatchStore
from nemo_rl.algorithms.grpo_step.step import grpo_step, validate
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.algorithms.sft import run_sft_steps
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.utils.run_config import check_resume, save_run_config
from nemo_rl.utils.run_stop import RunStopped, StopGuard

# Folder (under checkpointing.checkpoint_dir) of the SFT warm start's policy: the reference policy
# of a warm-started run, reloaded on resume.
SFT_WARMUP_DIR = "sft_warmup"


def _cluster_shape(cfg: GRPOMasterConfig) -> tuple[list[int], bool, float]:
    """Bundles per node, whether they hold GPUs, and CPUs per bundle.

    Colocated: the one cluster takes half a node's CPUs (the rest is left to the environments
    and the driver's tasks). Non-colocated: the policy and generation clusters split what the
    environment actors leave, half each; an environment actor Ray cannot place would leave
    every rollout waiting for its step timeout.

    Raises:
        ValueError: ``cluster.cpus_per_node`` leaves no CPUs for the clusters or the
            environments.
    """
    c = cfg.cluster
    use_gpus = c.gpus_per_node > 0
    per_node = c.gpus_per_node if use_gpus else c.cpu_bundles_per_node
    env_cpus = cfg.env.total_cpus
    if cfg.policy.generation.colocated.enabled:
        cluster_cpus = c.cpus_per_node / 2
        spare = c.cpus_per_node - cluster_cpus
    else:
        cluster_cpus = (c.cpus_per_node - env_cpus) / 2
        spare = c.cpus_per_node - 2 * cluster_cpus
    if cluster_cpus <= 0 or spare < env_cpus:
        raise ValueError(
            f"cluster.cpus_per_node={c.cpus_per_node} cannot hold the policy/generation "
            f"clusters and the environment actors ({env_cpus:g} CPUs, env.*.num_cpus); "
            "raise cluster.cpus_per_node (logical CPUs may exceed the cores) or lower "
            "env.*.num_cpus"
        )
    return [per_node] * c.num_nodes, use_gpus, cluster_cpus / per_node


def setup(cfg: GRPOMasterConfig) -> GRPOComponents:
    """Data, Ray, clusters, policy, generation engines, environments, loss, logger and
    checkpoints of a run; resumes from the latest checkpoint when checkpointing is enabled.

    Raises:
        ConfigError: before anything starts, when the latest checkpoint was trained on another
            model or data than ``cfg`` names (:func:`~nemo_rl.utils.run_config.check_resume`).

    Colocated generation (``policy.generation.colocated.enabled``) puts the engines on the
    policy's bundles; otherwise they get a cluster of the same shape of their own.
    """
    from nemo_rl.data.dataloader import StatefulPromptLoader
    from nemo_rl.data.datasets import (
        check_prompt_lengths,
        setup_demonstration_dataset,
        setup_synthetic_sft_dataset,
    )
    from nemo_rl.data.llm_message_utils import rl_collate_fn
    from nemo_rl.distributed.ray_bootstrap import init_ray
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.environments.utils import create_environments
    from nemo_rl.models.generation.vllm import VllmGeneration
    from nemo_rl.models.policy.lm_policy import Policy
    from nemo_rl.utils.checkpoint import CheckpointManager
    from nemo_rl.utils.logger import Logger
    from nemo_rl.utils.timer import Timer

    checkpointer = CheckpointManager(cfg.checkpointing) if cfg.checkpointing.enabled else None
    latest = checkpointer.get_latest_checkpoint_path() if checkpointer is not None else None
    if latest is not None:
        check_resume(latest, cfg)  # before Ray: a changed model or data is refused at once
    if checkpointer is not None:
        checkpointer.start_resume_check()  # hashing overlaps the set-up below
    inputs = load_run_inputs(cfg)
    model_path, tokenizer, pad = inputs.model_path, inputs.tokenizer, inputs.pad_token_id
    train, val = inputs.train, inputs.val
    loader = StatefulPromptLoader(
        train, cfg.grpo.prompts_per_generation_batch, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle
    )
    val_batches: list[BatchedDataDict] = []
    if val is not None and (cfg.grpo.val_period or cfg.grpo.val_at_start):
        rows = [val[i] for i in range(min(len(val), cfg.grpo.max_val_samples))]
        size = cfg.grpo.val_batch_size
        val_batches = [rl_collate_fn(rows[i : i + size]) for i in range(0, len(rows), size)]

    sft_loader = None
    if cfg.sft_warmup.enabled:
        warmup = cfg.sft_warmup
        sft_set = (
            setup_synthetic_sft_dataset(cfg.data, tokenizer, warmup.num_samples)
            if warmup.train_path is None
            else setup_demonstration_dataset(
                cfg.data, warmup.train_path, tokenizer, warmup.response_key
            )
        )
        check_prompt_lengths(sft_set, cfg.policy.max_total_sequence_length)
        sft_loader = StatefulPromptLoader(
            sft_set, cfg.sft_warmup.global_batch_size, seed=cfg.grpo.seed, shuffle=True
        )

    # Under `nemo-rl launch` (RAY_ADDRESS set) the cluster exists and has its own CPU count.
    local_cpus = cfg.cluster.cpus_per_node if cfg.cluster.gpus_per_node == 0 else None
    init_ray(num_cpus=None if os.environ.get("RAY_ADDRESS") else local_cpus)
    bundles, use_gpus, cpus = _cluster_shape(cfg)
    colocated = cfg.policy.generation.colocated.enabled
    train_cluster = RayVirtualCluster(
        bundles, use_gpus, cpus, max_colocated_worker_groups=2 if colocated else 1, name="policy"
    )
    clusters = [train_cluster]
    if not colocated:
        clusters.append(RayVirtualCluster(bundles, use_gpus, cpus, name="generation"))
    policy_cls, extra = Policy, {}
    if cfg.data_plane.enabled:
        from nemo_rl.models.policy.tq_policy import TQPolicy

        policy_cls, extra = TQPolicy, {"dp_cfg": cfg.data_plane}
    policy = policy_cls(
        train_cluster,
        cfg.policy,
        init_reference_model=uses_reference_policy(cfg),
        seed=cfg.grpo.seed,
        **extra,
    )
    generation = VllmGeneration(
        clusters[-1], cfg.policy.generation, model_path, pad_token_id=pad, seed=cfg.grpo.seed
    )
    logger = Logger(cfg.logger)
    logger.log_hyperparams(cfg.model_dump())
    return GRPOComponents(
        cfg=cfg,
        tokenizer=tokenizer,
        pad_token_id=pad,
        policy=policy,
        generation=generation,
        task_to_env=create_environments(cfg.env),
        train_loader=loader,
        val_batches=val_batches,
        loss_fn=ClippedPGLossFn(cfg.loss_fn),
        logger=logger,
        checkpointer=checkpointer,
        timer=Timer(),
        clusters=clusters,
        sft_loader=sft_loader,
    )


def save_checkpoint(
    components: GRPOComponents,
    step: int,
    val_metrics: dict[str, float],
    train_metrics: dict[str, float],
) -> Path:
    """Policy (model, optimizer, scheduler, RNG), data loader position, driver RNG and the
    resolved recipe (``config.yaml``) of ``step`` into a new checkpoint folder; the manager keeps the top-k and the latest, ranked
    by ``checkpointing.metric_name`` among the last validation's metrics (``val_`` prefixed)
    and the step's train metrics (``train_`` prefixed)."""
    from nemo_rl.utils.checkpoint import (
        DATALOADER_STATE_FILE,
        POLICY_DIR,
        RNG_STATE_FILE,
        save_rng_state,
    )

    manager = components.checkpointer
    info = {
        "step": step,
        # the engines' sampling seeds follow their call count: resume must continue it
        "generation_sampling_step": components.generation.sampling_step,
        **{f"val_{k}": v for k, v in val_metrics.items()},
        **{f"train_{k}": v for k, v in train_metrics.items()},
    }
    if "val_accuracy" in info:
        info.setdefault("val_reward", info["val_accuracy"])
    path = manager.init_tmp_checkpoint(step, info)
    save_run_config(path, components.cfg)
    components.policy.save_checkpoint(str(path / POLICY_DIR))
    torch.save(components.train_loader.state_dict(), path / DATALOADER_STATE_FILE)
    save_rng_state(path / RNG_STATE_FILE)
    return manager.finalize_checkpoint(path)


def restore_checkpoint(components: GRPOComponents) -> int:
    """Load the checkpoint :meth:`~nemo_rl.utils.checkpoint.CheckpointManager.resume_checkpoint`
    picks (verified against its manifest); returns its step (0 without one).

    Raises:
        CheckpointError: ``checkpointing.resume_from`` names a missing or damaged checkpoint,
            or the SFT warm start's folder of a warm-started run is damaged.
    """
    from nemo_rl.utils.checkpoint import (
        DATALOADER_STATE_FILE,
        POLICY_DIR,
        RNG_STATE_FILE,
        CheckpointError,
        CheckpointManager,
        load_rng_state,
    )
    from nemo_rl.utils.checkpoint_manifest import verify_folder

    manager = components.checkpointer
    latest = manager.resume_checkpoint() if manager is not None else None
    if latest is None:
        return 0
    if components.sft_loader is not None and uses_reference_policy(components.cfg):
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
    components.policy.load_checkpoint(str(latest / POLICY_DIR))
    components.train_loader.load_state_dict(torch.load(latest / DATALOADER_STATE_FILE))
    load_rng_state(latest / RNG_STATE_FILE)
    components.generation_stale = True
    info = CheckpointManager.load_training_info(latest)
    components.generation.sampling_step = int(info["generation_sampling_step"])
    print(f"resumed from {latest} (step {info['step']})")
    return int(info["step"])


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
    """Run GRPO from the resumed checkpoint (or step 0) to ``grpo.max_num_steps``, through the
    batch store of :func:`open_batch_store`.

    With checkpointing, a stop signal or ``checkpointing.checkpoint_must_save_by`` ends the
    loop early by the rule of :mod:`nemo_rl.utils.run_stop`: the finished step is saved, then
    :class:`~nemo_rl.utils.run_stop.RunStopped` (exit code 75) is raised.

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).
    """
    if components.checkpointer is None:  # nothing to save: signals keep their default effect
        return _train_loop(components, None)
    ckpt = components.cfg.checkpointing
    with StopGuard(ckpt.stop_signals, ckpt.must_save_by_seconds()) as guard:
        return _train_loop(components, guard)


def _train_loop(components: GRPOComponents, guard: StopGuard | None) -> dict[str, float]:
    """:func:`grpo_train`'s body; ``guard`` is None without checkpointing."""
    cfg, logger, timer = components.cfg, components.logger, components.timer
    step = restore_checkpoint(components)
    if step == 0 and components.sft_loader is not None:
        sft_warm_start(components)
    store = open_batch_store(components)
    try:
        last: dict[str, float] = {}
        val_metrics: dict[str, float] = {}
        if cfg.grpo.val_at_start and step == 0 and components.val_batches:
            val_metrics = validate(components, store)
            logger.log_metrics(val_metrics, step, "validation")
        if guard is not None and (reason := guard.stop_reason()) is not None:
            raise RunStopped(reason, step)  # signalled before the first step: nothing new
        batches = iter(components.train_loader)
        while step < cfg.grpo.max_num_steps:
            started = time.monotonic()
            with logger.step_progress(step + 1, cfg.grpo.max_num_steps, timer):
                last = grpo_step(components, store, batches)
            step += 1
            logger.log_metrics(last, step, "train")
            timing = {**timer.summary(), "total_step_time": time.monotonic() - started}
            logger.log_metrics(timing, step, "timing/train")
            timer.reset()
            if cfg.grpo.val_period and step % cfg.grpo.val_period == 0 and components.val_batches:
                val_metrics = validate(components, store)
                logger.log_metrics(val_metrics, step, "validation")
            if guard is not None:
                guard.step_finished(time.monotonic() - started)
                _save_or_stop(components, guard, step, val_metrics, last)
    finally:
        store.close()
    return {**last, **{f"val_{k}": v for k, v in val_metrics.items()}}


def _save_or_stop(
    components: GRPOComponents,
    guard: StopGuard,
    step: int,
    val_metrics: dict[str, float],
    train_metrics: dict[str, float],
) -> None:
    """After ``step``: save on ``save_period`` and at the last step; then, when a stop signal
    came or ``checkpoint_must_save_by`` is near, save the step (if not just saved) and raise
    :class:`~nemo_rl.utils.run_stop.RunStopped`.
    """
    cfg = components.cfg

    def save() -> None:
        started = time.monotonic()
        save_checkpoint(components, step, val_metrics, train_metrics)
        guard.save_finished(time.monotonic() - started)

    final_step = step == cfg.grpo.max_num_steps
    due = step % cfg.checkpointing.save_period == 0 or final_step
    if due:
        save()
    reason = guard.stop_reason()
    if reason is None or final_step:
        return
    if not due:
        save()
    raise RunStopped(reason, step)


def shutdown(components: GRPOComponents) -> None:
    """Stop engines, policy workers, environments and clusters; close the logger."""
    from nemo_rl.environments.utils import shutdown_environments

    components.generation.shutdown()
    components.policy.shutdown()
    shutdown_environments(components.task_to_env)
    for cluster in components.clusters:
        cluster.shutdown()
    components.logger.close()


def run(cfg: GRPOMasterConfig) -> int | None:
    """``nemo-rl grpo``: set up, train, print where logs and checkpoints are, shut down.

    Returns:
        None when the run finished; 75 (:data:`~nemo_rl.utils.run_stop.RESUMABLE_EXIT_CODE`)
        when it saved and stopped early (a stop signal, ``checkpoint_must_save_by``).
    """
    from nemo_rl.distributed.ray_bootstrap import shutdown_ray
    from nemo_rl.utils.plot import plot_training_curves

    components = setup(cfg)
    try:
        final = grpo_train(components)
    except RunStopped as stop:
        print(stop)
        return stop.code
    finally:
        shutdown(components)
        shutdown_ray()
    log_dir = Path(cfg.logger.log_dir)
    plot = plot_training_curves(components.logger.metrics_path, log_dir / "reward_curve.png")
    print(f"final metrics: { {k: round(v, 4) for k, v in final.items()} }")
    print(f"logs: {log_dir}  plot: {plot}")
    if components.checkpointer is not None:
        print(f"checkpoints: {cfg.checkpointing.checkpoint_dir}")
