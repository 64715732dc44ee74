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

import dataclasses
import functools
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_rl.algorithms import training_loop
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig, RolloutMasterConfig
from nemo_rl.algorithms.grpo_inputs import RunInputs, load_run_inputs
from nemo_rl.algorithms.grpo_step.async_rollouts import (
    AsyncRollouts,
    LockedPolicy,
    ResumeCursor,
)
from nemo_rl.algorithms.grpo_step.components import (
    GRPOComponents,
    RolloutComponents,
    uses_reference_policy,
)
from nemo_rl.algorithms.grpo_step.data_plane import DataPlaneBatchStore
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.interfaces import BatchStore
from nemo_rl.algorithms.grpo_step.step import generate_groups, grpo_step, validate
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.algorithms.sft import run_sft_steps
from nemo_rl.algorithms.training_loop import LoopParts
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.refit import refit_policy_generation
from nemo_rl.utils.run_stop import RunStopped

# Folder (under checkpointing.checkpoint_dir) of the SFT warm start's policy: the reference policy
# of a warm-started run, reloaded on resume.
SFT_WARMUP_DIR = "sft_warmup"


def _cluster_shape(cfg: RolloutMasterConfig) -> tuple[list[int], bool, float]:
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


def start_rollout_run(
    cfg: RolloutMasterConfig,
    inputs: RunInputs,
    init_reference_model: bool,
    extra_train_workers: Sequence[Callable[[Any], Any]] = (),
    policy_factory: Callable[..., Any] | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """The parts every rollout-trained run starts the same way: prompt loader and validation
    batches, Ray, clusters, the policy, the generation engines, environments and logger.

    Args:
        inputs: the run's model folder, tokenizer and prompts (:func:`load_run_inputs`).
        init_reference_model: the policy keeps its initial weights as the reference policy.
        extra_train_workers: factories ``(policy_cluster) -> workers`` of further worker
            groups on the policy's bundles (a distillation teacher); they start with the
            policy (:func:`start_train_and_generation`).
        policy_factory: ``(cluster, policy_cfg, init_reference_model=, seed=)`` -> the policy;
            None: :class:`~nemo_rl.models.policy.lm_policy.Policy`.

    Returns:
        The matching fields of :class:`~nemo_rl.algorithms.grpo_step.components.
        RolloutComponents` (``tokenizer``, ``pad_token_id``, ``policy``, ``generation``,
        ``task_to_env``, ``train_loader``, ``val_batches``, ``logger``, ``clusters``; the
        policy's cluster first), and what ``extra_train_workers`` built, in their order.

    Colocated generation (``policy.generation.colocated.enabled``) puts the engines on the
    policy's bundles; otherwise they get a cluster of the same shape of their own.
    """
    from nemo_rl.data.dataloader import StatefulPromptLoader
    from nemo_rl.data.llm_message_utils import rl_collate_fn
    from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.environments.utils import create_environments
    from nemo_rl.models.generation.vllm import VllmGeneration
    from nemo_rl.models.generation.vllm.async_generation import vllm_generation
    from nemo_rl.models.policy.lm_policy import Policy
    from nemo_rl.utils.logger import Logger

    loop = cfg.loop
    loader = StatefulPromptLoader(
        inputs.train, loop.prompts_per_generation_batch, seed=loop.seed, shuffle=cfg.data.shuffle
    )
    val_batches: list[BatchedDataDict] = []
    if inputs.val is not None and loop.validates:
        rows = [inputs.val[i] for i in range(min(len(inputs.val), loop.max_val_samples))]
        size = loop.val_batch_size
        val_batches = [rl_collate_fn(rows[i : i + size]) for i in range(0, len(rows), size)]

    # Under `nemo-rl launch` (RAY_ADDRESS set) the cluster exists and has its own CPU count.
    local_cpus = cfg.cluster.cpus_per_node if cfg.cluster.gpus_per_node == 0 else None
    init_ray(num_cpus=None if os.environ.get("RAY_ADDRESS") else local_cpus)
    clusters: list[RayVirtualCluster] = []
    try:
        bundles, use_gpus, cpus = _cluster_shape(cfg)
        colocated = cfg.policy.generation.colocated.enabled
        # not colocated: the generation cluster's bundles compute beside the policy's
        beside = 0 if colocated else bundles[0]
        train_cluster = RayVirtualCluster(
            bundles,
            use_gpus,
            cpus,
            max_colocated_worker_groups=(2 if colocated else 1) + len(extra_train_workers),
            name="policy",
            other_bundles_per_node=beside,
        )
        clusters = [train_cluster]
        if not colocated:
            clusters.append(RayVirtualCluster(bundles, use_gpus, cpus, name="generation",
                                              other_bundles_per_node=beside))

        def start_policy() -> Any:
            return (policy_factory or Policy)(
                train_cluster, cfg.policy, init_reference_model=init_reference_model, seed=loop.seed
            )

        def start_generation() -> VllmGeneration:
            return vllm_generation(
                clusters[-1],
                cfg.policy.generation,
                inputs.model_path,
                pad_token_id=inputs.pad_token_id,
                seed=loop.seed,
            )

        extras = [functools.partial(factory, train_cluster) for factory in extra_train_workers]
        (policy, *extra), generation = start_train_and_generation(
            [start_policy, *extras], start_generation, colocated and use_gpus
        )
        logger = Logger(cfg.logger)
        logger.log_hyperparams(cfg.model_dump())
        return {
            "tokenizer": inputs.tokenizer,
            "pad_token_id": inputs.pad_token_id,
            "policy": policy,
            "generation": generation,
            "task_to_env": create_environments(cfg.env),
            "train_loader": loader,
            "val_batches": val_batches,
            "logger": logger,
            "clusters": clusters,
        }, extra
    except BaseException:  # a failed start leaves neither bundles nor its init_ray behind
        for cluster in clusters:
            cluster.shutdown()
        shutdown_ray()
        raise


def start_train_and_generation(
    train_factories: Sequence[Callable[[], Any]],
    start_generation: Callable[[], Any],
    colocated_on_gpus: bool,
) -> tuple[list[Any], Any]:
    """Start the worker groups that train or score on the policy's bundles (the policy, a
    teacher) and the generation engines; what each factory built, in order, and the engines.

    Engines colocated on GPUs size their KV cache from the memory free when they start, so
    every group sharing their GPUs is loaded first (the groups start together, then the
    engines). Otherwise all start at once (:func:`~nemo_rl.distributed.worker_groups.
    start_together`). A failed start shuts down what the others built.
    """
    from nemo_rl.distributed.worker_groups import start_together

    if not colocated_on_gpus:
        *trained, generation = start_together(*train_factories, start_generation)
        return trained, generation
    trained = start_together(*train_factories)
    try:
        return trained, start_generation()
    except BaseException:
        for workers in trained:
            workers.shutdown()
        raise


def setup(cfg: GRPOMasterConfig) -> GRPOComponents:
    """Data, Ray, clusters, policy, generation engines, environments, loss, logger and
    checkpoints of a run (:func:`start_rollout_run`), the SFT warm start's data; resumes from
    the latest checkpoint when checkpointing is enabled.

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
    parts, _ = start_rollout_run(
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


def loop_parts(components: RolloutComponents) -> LoopParts:
    """What the shared training loop reads of a run trained on rollouts (its loop section)."""
    loop = components.cfg.loop
    return training_loop.loop_parts(components, loop, loop.max_num_steps)


def checkpoint_info(components: RolloutComponents, metrics: dict[str, float]) -> dict[str, Any]:
    """A rollout-trained run's entries of a checkpoint's training info: the engines' sampling step (their
    sampling seeds follow their call count: resume must continue it) and ``val_reward`` (the
    validation accuracy) when validation reports no reward of its own."""
    info: dict[str, Any] = {"generation_sampling_step": components.generation.sampling_step}
    if "val_accuracy" in metrics and "val_reward" not in metrics:
        info["val_reward"] = metrics["val_accuracy"]
    return info


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

    return restore_rollout_checkpoint(components, reload_warm_reference)


def restore_rollout_checkpoint(
    components: RolloutComponents, before_policy_load: Callable[[Path], None] | None = None
) -> int:
    """Resume a rollout-trained run from the checkpoint the manager picks
    (:func:`~nemo_rl.algorithms.training_loop.restore_checkpoint`) and continue the engines'
    sampling step (stale engines take the restored weights first); returns the step (0
    without a checkpoint)."""
    step, info = training_loop.restore_checkpoint(loop_parts(components), before_policy_load)
    if info:
        components.generation_stale = True
        components.generation.sampling_step = int(info["generation_sampling_step"])
    return step


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

    With checkpointing, a stop signal or ``checkpointing.checkpoint_must_save_by`` ends the
    loop early by the rule of :mod:`nemo_rl.utils.run_stop`: the finished step is saved, then
    :class:`~nemo_rl.utils.run_stop.RunStopped` (exit code 75) is raised.

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).
    """
    parts = loop_parts(components)
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
                extra_info=lambda metrics: checkpoint_info(components, metrics),
            )
        finally:
            store.close()


def train_async(components: GRPOComponents, guard: Any, step: int) -> dict[str, float]:
    """:func:`grpo_train`'s loop with ``grpo.async_grpo.enabled``: the same step over a
    collector that generates ahead (:mod:`~nemo_rl.algorithms.grpo_step.async_rollouts`).

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
    parts = dataclasses.replace(loop_parts(components), train_loader=ResumeCursor(source))

    def validate_async() -> dict[str, float]:
        with source.engines():
            return validate(components, store)

    def extra_info(metrics: dict[str, float]) -> dict[str, Any]:
        return {
            **checkpoint_info(components, metrics),
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


def shutdown(components: RolloutComponents) -> None:
    """Stop engines, policy workers, environments and clusters; close the logger; undo
    :func:`setup`'s ``init_ray`` (which stops Ray only if the run started it)."""
    from nemo_rl.distributed.ray_bootstrap import shutdown_ray
    from nemo_rl.environments.utils import shutdown_environments

    components.generation.shutdown()
    components.policy.shutdown()
    shutdown_environments(components.task_to_env)
    for cluster in components.clusters:
        cluster.shutdown()
    components.logger.close()
    shutdown_ray()


def run_rollout_command(
    components: RolloutComponents,
    train: Callable[[], dict[str, float]],
    stop: Callable[[], None],
    curves: tuple[tuple[str, str], tuple[str, str]],
) -> int | None:
    """Train a set-up run, shut it down (``stop``) and report where its logs, plot
    ``reward_curve.png`` of ``curves`` and checkpoints are.

    Returns:
        None when the run finished; 75 (:data:`~nemo_rl.utils.run_stop.RESUMABLE_EXIT_CODE`)
        when it saved and stopped early (a stop signal, ``checkpoint_must_save_by``).
    """
    try:
        final = train()
    except RunStopped as stopped:
        print(stopped)
        return stopped.code
    finally:
        stop()
    training_loop.report_finished(loop_parts(components), final, "reward_curve.png", curves)
    return None


def run(cfg: GRPOMasterConfig) -> int | None:
    """``nemo-rl grpo``: set up, train, print where logs and checkpoints are, shut down.

    Returns:
        None when the run finished; 75 (:data:`~nemo_rl.utils.run_stop.RESUMABLE_EXIT_CODE`)
        when it saved and stopped early (a stop signal, ``checkpoint_must_save_by``).
    """
    components = setup(cfg)
    return run_rollout_command(
        components,
        lambda: grpo_train(components),
        lambda: shutdown(components),
        (("train", "reward"), ("validation", "accuracy")),
    )
