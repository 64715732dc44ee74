"""The run of an algorithm that trains the policy on its own rollouts: GRPO, distillation.

:func:`start_rollout_run` brings a run up (prompt loader and validation batches, Ray, the
clusters, the policy and any worker groups sharing its bundles, the vLLM engines, the
environments, the logger) into the fields of :class:`RolloutComponents`, what such a run
holds; :func:`restore_rollout_checkpoint` resumes it; :func:`loop_parts` and
:func:`checkpoint_info` are what the shared :func:`~nemo_rl.algorithms.training_loop.train_loop`
reads of it; :func:`run_rollout_command` is a command's body after set-up (train, shut down,
report) and :func:`shutdown` stops everything :func:`start_rollout_run` started. The rollout
counterpart of :mod:`nemo_rl.algorithms.supervised`; its config is
:class:`~nemo_rl.algorithms.rollout_config.RolloutMasterConfig`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nemo_rl.algorithms import training_loop
from nemo_rl.algorithms.rollout_config import RolloutMasterConfig
from nemo_rl.algorithms.rollout_inputs import RunInputs
from nemo_rl.algorithms.training_loop import LoopParts
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.grouped_rollouts import RolloutRunner
from nemo_rl.utils.run_stop import RunStopped


@dataclass
class RolloutComponents:
    """Everything a run trained on the policy's rollouts holds (GRPO, distillation).

    Attributes:
        cfg: the run's master config; ``cfg.loop`` is its loop section.
        loss_fn: the loss the policy trains on.
        generation_stale: the policy changed since the engines' last refit.
    """

    cfg: RolloutMasterConfig
    tokenizer: Any
    pad_token_id: int
    policy: Any
    generation: Any
    task_to_env: dict[str, Any]
    train_loader: Any
    val_batches: list[BatchedDataDict]
    loss_fn: Any
    logger: Any
    checkpointer: Optional[Any]
    timer: Any
    clusters: list[Any]
    generation_stale: bool = False

    def checkpointed_models(self) -> dict[str, Any]:
        """Trained models other than the policy, saved and restored with it, by checkpoint
        subfolder (none here; PPO's critic)."""
        return {}

    def rollout_runner(self) -> RolloutRunner:
        """The run's rollout (its engines, tokenizer, environments and limits)."""
        return RolloutRunner(
            generation=self.generation,
            tokenizer=self.tokenizer,
            task_to_env=self.task_to_env,
            max_seq_len=self.cfg.policy.max_total_sequence_length,
            max_rollout_turns=self.cfg.loop.max_rollout_turns,
            pad_token_id=self.pad_token_id,
        )


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
        inputs: the run's model folder, tokenizer and prompts
            (:func:`~nemo_rl.algorithms.rollout_inputs.load_run_inputs`).
        init_reference_model: the policy keeps its initial weights as the reference policy.
        extra_train_workers: factories ``(policy_cluster) -> workers`` of further worker
            groups on the policy's bundles (a distillation teacher); they start with the
            policy (:func:`start_train_and_generation`).
        policy_factory: ``(cluster, policy_cfg, init_reference_model=, seed=)`` -> the policy;
            None: :class:`~nemo_rl.models.policy.lm_policy.Policy`.

    Returns:
        The matching fields of :class:`RolloutComponents` (``tokenizer``, ``pad_token_id``,
        ``policy``, ``generation``, ``task_to_env``, ``train_loader``, ``val_batches``,
        ``logger``, ``clusters``; the policy's cluster first), and what
        ``extra_train_workers`` built, in their order.

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
                adapters=cfg.policy.adapter_serving(),
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


def loop_parts(components: RolloutComponents) -> LoopParts:
    """What the shared training loop reads of a run trained on rollouts (its loop section,
    the models it checkpoints besides the policy)."""
    loop = components.cfg.loop
    return training_loop.loop_parts(
        components, loop, loop.max_num_steps, components.checkpointed_models()
    )


def checkpoint_info(components: RolloutComponents, metrics: dict[str, float]) -> dict[str, Any]:
    """A rollout-trained run's entries of a checkpoint's training info: the engines' sampling
    step (their sampling seeds follow their call count: resume must continue it) and
    ``val_reward`` (the validation accuracy) when validation reports no reward of its own."""
    info: dict[str, Any] = {"generation_sampling_step": components.generation.sampling_step}
    if "val_accuracy" in metrics and "val_reward" not in metrics:
        info["val_reward"] = metrics["val_accuracy"]
    return info


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


def shutdown(components: RolloutComponents) -> None:
    """Stop engines, policy workers, environments and clusters; close the logger; undo
    :func:`start_rollout_run`'s ``init_ray`` (which stops Ray only if the run started it)."""
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
        when it saved and stopped early (a stop signal, ``checkpoint_must_save_by``); 128 + the
        signal number when a stop signal ended it without checkpointing (nothing saved).
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
