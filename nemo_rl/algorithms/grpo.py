"""GRPO: sample groups of responses per prompt, score them, and train on group-relative advantages.

One step (:func:`grpo_step`):

1. ``num_prompts_per_step`` prompts from the data loader, each repeated
   ``num_generations_per_prompt`` times (a group).
2. Refit the generation engines if the policy changed since their last update, then
   :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` against the environments.
3. Advantages per group (:func:`~nemo_rl.algorithms.advantage_estimators.grpo_advantages`).
4. The conversations flattened into ``[B, S]`` training data (loss on assistant tokens only),
   the policy's logprobs before the update (``prev_logprobs``) and the reference policy's.
5. ``policy.train`` with :class:`~nemo_rl.algorithms.loss.ClippedPGLossFn`.

:func:`setup` builds everything from a :class:`~nemo_rl.algorithms.grpo_config.GRPOMasterConfig`
and :func:`grpo_train` runs the loop with validation and checkpoints; :func:`run` is the
``nemo-rl grpo`` entry point.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from nemo_rl.algorithms.advantage_estimators import grpo_advantages
from nemo_rl.algorithms.grpo_config import GRPOConfig, GRPOMasterConfig
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.generation.refit import refit_policy_generation

def repeat_prompts(batch: BatchedDataDict, num_generations: int) -> tuple[BatchedDataDict, torch.Tensor]:
    """Each prompt row ``num_generations`` times in a row, and ``[B * n]`` group ids."""
    group_ids = torch.arange(batch.size).repeat_interleave(num_generations)
    return batch.repeat_interleave(num_generations), group_ids


def build_train_data(
    rollout: BatchedDataDict,
    group_ids: torch.Tensor,
    grpo_cfg: GRPOConfig,
    pad_token_id: int,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """Flatten rolled-out conversations into training data with GRPO advantages.

    Args:
        rollout: :func:`run_multi_turn_rollout` output: ``message_log``, ``total_reward``
            ``[B]``, ``loss_multiplier`` ``[B]``.
        group_ids: ``[B]`` prompt index of each row.
        grpo_cfg: advantage settings.
        pad_token_id: fills ``input_ids`` past each row's length.

    Returns:
        ``(data, metrics)``: ``data`` holds ``input_ids``, ``token_mask``, ``advantages``,
        ``generation_logprobs`` (``[B, S]``) and ``input_lengths``, ``sample_mask`` (``[B]``);
        metrics: ``fraction_of_zero_std_groups``.
    """
    flat = message_logs_to_flat(rollout["message_log"], pad_token_id)
    rewards = rollout["total_reward"].float()
    advantages = grpo_advantages(
        rewards,
        group_ids,
        flat["token_mask"],
        use_leave_one_out_baseline=grpo_cfg.use_leave_one_out_baseline,
        normalize_rewards=grpo_cfg.normalize_rewards,
    )
    sample_mask = torch.as_tensor(rollout["loss_multiplier"], dtype=torch.float32)
    data = BatchedDataDict(
        input_ids=flat["input_ids"],
        input_lengths=flat["input_lengths"],
        token_mask=flat["token_mask"].float(),
        sample_mask=sample_mask,
        advantages=advantages,
        generation_logprobs=flat["generation_logprobs"].float(),
    )
    group_std = torch.stack(
        [rewards[group_ids == g].std(unbiased=False) for g in torch.unique(group_ids)]
    )
    metrics = {"fraction_of_zero_std_groups": float((group_std == 0).float().mean())}
    return data, metrics


def step_metrics(
    rollout_metrics: dict[str, float],
    train_results: dict[str, Any],
    data_metrics: dict[str, float],
) -> dict[str, float]:
    """One flat ``{name: value}`` of a GRPO step's figures (NeMo RL's metric names where they
    exist: ``loss``, ``grad_norm``, ``lr``, ``reward``, ``token_mult_prob_error``, ...)."""
    metrics: dict[str, float] = {
        "loss": float(train_results["loss"][-1]),
        "grad_norm": float(train_results["grad_norm"][-1]),
        "lr": float(train_results["lr"][-1]),
        "reward": rollout_metrics["reward_mean"],
    }
    for key, values in train_results["metrics"].items():
        metrics[key] = float(values[-1])
    metrics.update({f"rollout/{k}": v for k, v in rollout_metrics.items()})
    metrics.update(data_metrics)
    return metrics


@dataclass
class GRPOComponents:
    """Everything a GRPO run holds (built by :func:`setup`).

    Attributes:
        generation_stale: the policy changed since the engines' last refit.
    """

    cfg: GRPOMasterConfig
    tokenizer: Any
    pad_token_id: int
    policy: Any
    generation: Any
    task_to_env: dict[str, Any]
    train_loader: Any
    val_batches: list[BatchedDataDict]
    loss_fn: ClippedPGLossFn
    logger: Any
    checkpointer: Optional[Any]
    timer: Any
    clusters: list[Any]
    generation_stale: bool = False


def prepare_generation(components: GRPOComponents) -> None:
    """Refit the engines if the policy changed since their last update, and wake them."""
    if components.generation_stale:
        refit_policy_generation(
            components.policy,
            components.generation,
            components.cfg.policy.generation.colocated.enabled,
        )
        components.generation_stale = False
    components.generation.prepare_for_generation()


def grpo_step(
    components: GRPOComponents,
    prompts: BatchedDataDict,
) -> dict[str, float]:
    """One GRPO step on ``prompts`` (DatumSpec rows); returns its metrics (see module docstring)."""
    cfg, timer = components.cfg, components.timer
    policy, generation = components.policy, components.generation
    batch, group_ids = repeat_prompts(prompts, cfg.grpo.num_generations_per_prompt)
    with timer.time("refit"):
        prepare_generation(components)
    with timer.time("generation"):
        rollout, rollout_metrics = run_multi_turn_rollout(
            generation,
            batch,
            components.tokenizer,
            components.task_to_env,
            max_seq_len=cfg.policy.max_total_sequence_length,
            max_rollout_turns=cfg.grpo.max_rollout_turns,
        )
        generation.finish_generation()
    with timer.time("data_processing"):
        data, data_metrics = build_train_data(
            rollout, group_ids, cfg.grpo, components.pad_token_id
        )
    policy.prepare_for_training()
    with timer.time("policy_logprobs"):
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        with timer.time("reference_logprobs"):
            reference = policy.get_reference_policy_logprobs(data)
            data["reference_policy_logprobs"] = reference["reference_logprobs"]
    with timer.time("policy_training"):
        train_results = policy.train(data, components.loss_fn)
    policy.finish_training()
    components.generation_stale = True
    return step_metrics(rollout_metrics, train_results, data_metrics)


def validate(components: GRPOComponents) -> dict[str, float]:
    """Greedy rollouts of the validation prompts; mean reward (= accuracy for 0/1 rewards)."""
    generation = components.generation
    prepare_generation(components)
    rewards, lengths = [], []
    for batch in components.val_batches:
        rollout, metrics = run_multi_turn_rollout(
            generation,
            batch,
            components.tokenizer,
            components.task_to_env,
            max_seq_len=components.cfg.policy.max_total_sequence_length,
            max_rollout_turns=components.cfg.grpo.max_rollout_turns,
            greedy=True,
        )
        rewards.append(rollout["total_reward"])
        lengths.append(metrics["mean_generated_tokens_per_sample"])
    generation.finish_generation()
    all_rewards = torch.cat(rewards)
    return {
        "accuracy": float(all_rewards.mean()),
        "num_samples": float(all_rewards.numel()),
        "mean_generated_tokens_per_sample": sum(lengths) / max(len(lengths), 1),
    }


def _cluster_shape(cfg: GRPOMasterConfig) -> tuple[list[int], bool, float]:
    """Bundles per node, whether they hold GPUs, and CPUs per bundle (half a node's CPUs
    spread over its bundles: the other half is left to the second cluster or the
    environments)."""
    c = cfg.cluster
    use_gpus = c.gpus_per_node > 0
    per_node = c.gpus_per_node if use_gpus else c.cpu_bundles_per_node
    return [per_node] * c.num_nodes, use_gpus, c.cpus_per_node / per_node / 2


def setup(cfg: GRPOMasterConfig) -> GRPOComponents:
    """Data, Ray, clusters, policy, generation engines, environments, loss, logger and
    checkpoints of a run; resumes from the latest checkpoint when checkpointing is enabled.

    Colocated generation (``policy.generation.colocated.enabled``) puts the engines on the
    policy's bundles; otherwise they get a cluster of the same shape of their own.
    """
    from transformers import AutoTokenizer

    from nemo_rl.data.dataloader import StatefulPromptLoader
    from nemo_rl.data.datasets import check_prompt_lengths, setup_datasets
    from nemo_rl.data.llm_message_utils import rl_collate_fn
    from nemo_rl.distributed.ray_bootstrap import init_ray
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.environments.utils import create_environments
    from nemo_rl.models.generation.vllm import VllmGeneration
    from nemo_rl.models.policy.lm_policy import Policy
    from nemo_rl.models.tiny import resolve_model_path
    from nemo_rl.utils.checkpoint import CheckpointManager
    from nemo_rl.utils.logger import Logger
    from nemo_rl.utils.timer import Timer

    model_path = resolve_model_path(cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train, val, _ = setup_datasets(cfg.data, tokenizer)
    check_prompt_lengths(train, cfg.policy.max_total_sequence_length)
    loader = StatefulPromptLoader(
        train, cfg.grpo.num_prompts_per_step, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle
    )
    val_batches: list[BatchedDataDict] = []
    if val is not None and (cfg.grpo.val_period or cfg.grpo.val_at_start):
        rows = [val[i] for i in range(min(len(val), cfg.grpo.max_val_samples))]
        size = cfg.grpo.val_batch_size
        val_batches = [rl_collate_fn(rows[i : i + size]) for i in range(0, len(rows), size)]

    init_ray(num_cpus=cfg.cluster.cpus_per_node if cfg.cluster.gpus_per_node == 0 else None)
    bundles, use_gpus, cpus = _cluster_shape(cfg)
    colocated = cfg.policy.generation.colocated.enabled
    train_cluster = RayVirtualCluster(
        bundles, use_gpus, cpus, max_colocated_worker_groups=2 if colocated else 1, name="policy"
    )
    clusters = [train_cluster]
    if not colocated:
        clusters.append(RayVirtualCluster(bundles, use_gpus, cpus, name="generation"))
    policy = Policy(
        train_cluster,
        cfg.policy,
        init_reference_model=cfg.loss_fn.reference_policy_kl_penalty > 0,
        seed=cfg.grpo.seed,
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
        checkpointer=CheckpointManager(cfg.checkpointing) if cfg.checkpointing.enabled else None,
        timer=Timer(),
        clusters=clusters,
    )


def save_checkpoint(components: GRPOComponents, step: int, val_metrics: dict[str, float]) -> Path:
    """Policy (model, optimizer, scheduler, RNG), data loader position and driver RNG of
    ``step`` into a new checkpoint folder; the manager keeps the top-k and the latest."""
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
    }
    if "val_accuracy" in info:
        info.setdefault("val_reward", info["val_accuracy"])
    path = manager.init_tmp_checkpoint(step, info)
    components.policy.save_checkpoint(str(path / POLICY_DIR))
    torch.save(components.train_loader.state_dict(), path / DATALOADER_STATE_FILE)
    save_rng_state(path / RNG_STATE_FILE)
    return manager.finalize_checkpoint(path)


def restore_latest_checkpoint(components: GRPOComponents) -> int:
    """Load the latest checkpoint if there is one; returns its step (0 without one)."""
    from nemo_rl.utils.checkpoint import (
        DATALOADER_STATE_FILE,
        POLICY_DIR,
        RNG_STATE_FILE,
        CheckpointManager,
        load_rng_state,
    )

    manager = components.checkpointer
    latest = manager.get_latest_checkpoint_path() if manager is not None else None
    if latest is None:
        return 0
    components.policy.load_checkpoint(str(latest / POLICY_DIR))
    components.train_loader.load_state_dict(torch.load(latest / DATALOADER_STATE_FILE))
    load_rng_state(latest / RNG_STATE_FILE)
    components.generation_stale = True
    info = CheckpointManager.load_training_info(latest)
    components.generation.sampling_step = int(info["generation_sampling_step"])
    print(f"resumed from {latest} (step {info['step']})")
    return int(info["step"])


def grpo_train(components: GRPOComponents) -> dict[str, float]:
    """Run GRPO from the latest checkpoint (or step 0) to ``grpo.max_num_steps``.

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).
    """
    cfg, logger, timer = components.cfg, components.logger, components.timer
    step = restore_latest_checkpoint(components)
    last: dict[str, float] = {}
    val_metrics: dict[str, float] = {}
    if cfg.grpo.val_at_start and step == 0 and components.val_batches:
        val_metrics = validate(components)
        logger.log_metrics(val_metrics, step, "validation")
    batches = iter(components.train_loader)
    while step < cfg.grpo.max_num_steps:
        prompts = next(batches)
        with logger.step_progress(step + 1, cfg.grpo.max_num_steps, timer):
            last = grpo_step(components, prompts)
        step += 1
        logger.log_metrics(last, step, "train")
        logger.log_metrics(timer.summary(), step, "timing/train")
        timer.reset()
        if cfg.grpo.val_period and step % cfg.grpo.val_period == 0 and components.val_batches:
            val_metrics = validate(components)
            logger.log_metrics(val_metrics, step, "validation")
        if components.checkpointer is not None and (
            step % cfg.checkpointing.save_period == 0 or step == cfg.grpo.max_num_steps
        ):
            save_checkpoint(components, step, val_metrics)
    return {**last, **{f"val_{k}": v for k, v in val_metrics.items()}}


def shutdown(components: GRPOComponents) -> None:
    """Stop engines, policy workers, environments and clusters; close the logger."""
    from nemo_rl.environments.utils import shutdown_environments

    components.generation.shutdown()
    components.policy.shutdown()
    shutdown_environments(components.task_to_env)
    for cluster in components.clusters:
        cluster.shutdown()
    components.logger.close()


def run(cfg: GRPOMasterConfig) -> None:
    """``nemo-rl grpo``: set up, train, print where logs and checkpoints are, shut down."""
    from nemo_rl.distributed.ray_bootstrap import shutdown_ray
    from nemo_rl.utils.plot import plot_training_curves

    components = setup(cfg)
    try:
        final = grpo_train(components)
    finally:
        shutdown(components)
        shutdown_ray()
    log_dir = Path(cfg.logger.log_dir)
    plot = plot_training_curves(components.logger.metrics_path, log_dir / "reward_curve.png")
    print(f"final metrics: { {k: round(v, 4) for k, v in final.items()} }")
    print(f"logs: {log_dir}  plot: {plot}")
    if components.checkpointer is not None:
        print(f"checkpoints: {cfg.checkpointing.checkpoint_dir}")
