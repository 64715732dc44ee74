"""GRPO: sample groups of responses per prompt, score them, and train on group-relative advantages.

One step (:func:`grpo_step`):

1. ``num_prompts_per_step`` prompts from the data loader, each repeated
   ``num_generations_per_prompt`` times (a group).
2. Refit the generation engines if the policy changed since their last update, then
   :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` against the environments.
   With dynamic sampling, groups whose responses all scored the same are dropped and
   further prompts rolled out until ``num_prompts_per_step`` groups remain.
3. Advantages per group (:func:`~nemo_rl.algorithms.advantage_estimators.grpo_advantages`);
   with overlong filtering, responses cut by a token limit leave the loss.
4. The conversations flattened into ``[B, S]`` training data (loss on assistant tokens only),
   the policy's logprobs before the update (``prev_logprobs``) and the reference policy's.
5. ``policy.train`` with :class:`~nemo_rl.algorithms.loss.ClippedPGLossFn`.

:func:`setup` builds everything from a :class:`~nemo_rl.algorithms.grpo_config.GRPOMasterConfig`
and :func:`grpo_train` runs the loop (after the optional SFT warm start) with validation and
checkpoints; :func:`run` is the ``nemo-rl grpo`` entry point (the data-plane loop,
:mod:`nemo_rl.algorithms.grpo_sync`, when ``data_plane.enabled``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch

from nemo_rl.algorithms.advantage_estimators import grpo_advantages, group_reward_std
from nemo_rl.algorithms.grpo_config import GRPOConfig, GRPOMasterConfig
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.algorithms.sft import run_sft_steps
from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.generation.refit import refit_policy_generation

BatchT = TypeVar("BatchT")

# Folder (under checkpointing.checkpoint_dir) of the SFT warm start's policy: the reference policy
# of a warm-started run, reloaded on resume.
SFT_WARMUP_DIR = "sft_warmup"


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
            ``[B]``, ``loss_multiplier`` ``[B]``, ``truncated`` / ``response_truncated`` ``[B]``.
        group_ids: ``[B]`` prompt index of each row.
        grpo_cfg: advantage settings and ``overlong_filtering``.
        pad_token_id: fills ``input_ids`` past each row's length.

    Returns:
        ``(data, metrics)``: ``data`` holds ``input_ids``, ``token_mask``, ``advantages``,
        ``generation_logprobs`` (``[B, S]``) and ``input_lengths``, ``sample_mask`` (``[B]``);
        metrics: ``fraction_of_zero_std_groups`` and, with overlong filtering,
        ``overlong_filtered_fraction``.
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
    sample_mask, metrics = loss_sample_mask(
        torch.as_tensor(rollout["loss_multiplier"]),
        rollout["truncated"] | rollout["response_truncated"],
        grpo_cfg,
    )
    metrics["fraction_of_zero_std_groups"] = zero_std_group_fraction(rewards, group_ids)
    data = BatchedDataDict(
        input_ids=flat["input_ids"],
        input_lengths=flat["input_lengths"],
        token_mask=flat["token_mask"].float(),
        sample_mask=sample_mask,
        advantages=advantages,
        generation_logprobs=flat["generation_logprobs"].float(),
    )
    return data, metrics


def loss_sample_mask(
    loss_multiplier: torch.Tensor, overlong: torch.Tensor, grpo_cfg: GRPOConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` float sample mask of the loss: ``loss_multiplier``, times 0 for ``overlong``
    rows (cut by a token limit) when ``grpo_cfg.overlong_filtering``; with the filter, the
    metric ``overlong_filtered_fraction``."""
    sample_mask = loss_multiplier.float()
    if not grpo_cfg.overlong_filtering:
        return sample_mask, {}
    return sample_mask * (~overlong).float(), {
        "overlong_filtered_fraction": float(overlong.float().mean())
    }


def zero_std_group_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of prompt groups whose responses all got the same reward."""
    has_variance = group_reward_std(rewards, group_ids) > 0
    groups = torch.unique(group_ids)
    with_variance = torch.unique(group_ids[has_variance])
    return 1.0 - with_variance.numel() / groups.numel()


def merge_rollout_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    """Rollout metrics of several generation batches of one step: counts and times summed
    (``total_*``, ``*_time_s``, ``env_errors``), every other figure averaged."""
    merged: dict[str, float] = {}
    for key in per_batch[0]:
        values = [m[key] for m in per_batch]
        additive = key.startswith("total_") or key.endswith("_time_s") or key == "env_errors"
        merged[key] = sum(values) if additive else sum(values) / len(values)
    return merged


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
        sft_loader: batches of the SFT warm start (None when ``sft_warmup`` is off).
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
    sft_loader: Optional[Any] = None
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


def rollout_groups(
    components: GRPOComponents, prompts: BatchedDataDict
) -> tuple[BatchedDataDict, torch.Tensor, dict[str, float]]:
    """Refit if stale, then roll out ``num_generations_per_prompt`` responses per prompt.

    Returns:
        ``(rollout, group_ids, metrics)``: the :func:`run_multi_turn_rollout` batch, ``[B]``
        prompt index of each row, and the rollout metrics.
    """
    cfg, timer, generation = components.cfg, components.timer, components.generation
    batch, group_ids = repeat_prompts(prompts, cfg.grpo.num_generations_per_prompt)
    with timer.time("refit"):
        prepare_generation(components)
    with timer.time("generation"):
        rollout, metrics = run_multi_turn_rollout(
            generation,
            batch,
            components.tokenizer,
            components.task_to_env,
            max_seq_len=cfg.policy.max_total_sequence_length,
            max_rollout_turns=cfg.grpo.max_rollout_turns,
        )
        generation.finish_generation()
    return rollout, group_ids, metrics


def collect_groups_with_variance(
    roll_out: Callable[[], tuple[BatchT, torch.Tensor, torch.Tensor]],
    keep_rows: Callable[[BatchT, torch.Tensor], BatchT],
    grpo_cfg: GRPOConfig,
) -> tuple[list[BatchT], torch.Tensor, torch.Tensor, dict[str, float]]:
    """The loop of dynamic sampling, whatever holds a generation batch (a rollout batch, or
    data-plane metadata).

    Args:
        roll_out: rolls out the next generation batch: ``(batch, group_ids [B], rewards [B])``.
        keep_rows: ``batch`` restricted to the given ``[n]`` row indices (the rows of groups
            with reward variance).
        grpo_cfg: ``num_prompts_per_step`` and ``dynamic_sampling_max_gen_batches``.

    Returns:
        ``(kept, group_ids, keep, sampling_metrics)``: the restricted batches in order;
        ``[N]`` group ids of their rows (N rows in all), renumbered 0.. in order; ``[N]`` bool,
        the rows of the first ``num_prompts_per_step`` groups (the rest is surplus); and
        ``dynamic_sampling_num_gen_batches``, ``dynamic_sampling_num_discarded_valid_samples``.

    Raises:
        RuntimeError: fewer groups with variance than needed after
            ``grpo.dynamic_sampling_max_gen_batches`` generation batches.
    """
    needed = grpo_cfg.num_prompts_per_step
    kept: list[BatchT] = []
    kept_groups: list[torch.Tensor] = []
    num_kept = 0
    for num_gen_batches in range(1, grpo_cfg.dynamic_sampling_max_gen_batches + 1):
        batch, group_ids, rewards = roll_out()
        rows = torch.nonzero(group_reward_std(rewards.float(), group_ids) > 0).flatten()
        kept.append(keep_rows(batch, rows))
        kept_groups.append(group_ids[rows] + num_gen_batches * len(group_ids))
        num_kept += len(torch.unique(group_ids[rows]))
        if num_kept >= needed:
            break
    else:
        raise RuntimeError(
            f"dynamic sampling found {num_kept} of the {needed} prompt groups with reward "
            f"variance it needs after grpo.dynamic_sampling_max_gen_batches="
            f"{grpo_cfg.dynamic_sampling_max_gen_batches} generation batches; raise "
            "grpo.dynamic_sampling_max_gen_batches or grpo.batch_multiplier, raise "
            "grpo.num_generations_per_prompt, or use prompts of a difficulty where the "
            "policy's responses differ in reward"
        )
    _, group_ids = torch.unique(torch.cat(kept_groups), return_inverse=True)
    keep = group_ids < needed
    sampling_metrics = {
        "dynamic_sampling_num_gen_batches": float(num_gen_batches),
        "dynamic_sampling_num_discarded_valid_samples": float((~keep).sum()),
    }
    return kept, group_ids, keep, sampling_metrics


def sample_groups_with_variance(
    components: GRPOComponents, batches: Iterator[BatchedDataDict]
) -> tuple[BatchedDataDict, torch.Tensor, dict[str, float], dict[str, float]]:
    """Dynamic sampling: roll out generation batches until ``num_prompts_per_step`` prompt
    groups whose rewards differ are collected (:func:`collect_groups_with_variance`); groups
    with one reward for all responses are dropped, surplus groups of the last batch too.

    Returns:
        ``(rollout, group_ids, rollout_metrics, sampling_metrics)`` of exactly
        ``num_prompts_per_step`` groups (group ids renumbered 0..n-1): the rollout metrics
        merged over the generation batches, and the sampling metrics.

    Raises:
        RuntimeError: too few groups with reward variance (see
            :func:`collect_groups_with_variance`).
    """
    per_batch_metrics: list[dict[str, float]] = []

    def roll_out() -> tuple[BatchedDataDict, torch.Tensor, torch.Tensor]:
        rollout, group_ids, metrics = rollout_groups(components, next(batches))
        per_batch_metrics.append(metrics)
        return rollout, group_ids, rollout["total_reward"]

    kept, group_ids, keep, sampling_metrics = collect_groups_with_variance(
        roll_out, lambda rollout, rows: rollout.select_indices(rows), components.cfg.grpo
    )
    rollout = BatchedDataDict.from_batches(kept)
    return (
        rollout.select_indices(torch.nonzero(keep).flatten()),
        group_ids[keep],
        merge_rollout_metrics(per_batch_metrics),
        sampling_metrics,
    )


def grpo_step(
    components: GRPOComponents,
    batches: Iterator[BatchedDataDict],
) -> dict[str, float]:
    """One GRPO step on prompts from ``batches`` (collated DatumSpec rows; one batch, or
    several with dynamic sampling); returns its metrics (see module docstring)."""
    cfg, timer, policy = components.cfg, components.timer, components.policy
    sampling_metrics: dict[str, float] = {}
    if cfg.grpo.use_dynamic_sampling:
        rollout, group_ids, rollout_metrics, sampling_metrics = sample_groups_with_variance(
            components, batches
        )
    else:
        rollout, group_ids, rollout_metrics = rollout_groups(components, next(batches))
    with timer.time("data_processing"):
        data, data_metrics = build_train_data(
            rollout, group_ids, cfg.grpo, components.pad_token_id
        )
    data_metrics.update(sampling_metrics)
    policy.prepare_for_training()
    with timer.time("policy_logprobs"):
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    if uses_reference_policy(cfg):
        with timer.time("reference_logprobs"):
            reference = policy.get_reference_policy_logprobs(data)
            data["reference_policy_logprobs"] = reference["reference_logprobs"]
    with timer.time("policy_training"):
        train_results = policy.train(data, components.loss_fn)
    policy.finish_training()
    components.generation_stale = True
    return step_metrics(rollout_metrics, train_results, data_metrics)


def validate(components: GRPOComponents) -> dict[str, float]:
    """Rollouts of the validation prompts, sampled like training (greedy with
    ``grpo.val_greedy``); mean reward (= accuracy for 0/1 rewards)."""
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
            greedy=components.cfg.grpo.val_greedy,
        )
        rewards.append(rollout["total_reward"])
        lengths.append(metrics["mean_generated_tokens_per_sample"])
    generation.finish_generation()
    return validation_metrics(rewards, lengths)


def validation_metrics(rewards: list[torch.Tensor], lengths: list[float]) -> dict[str, float]:
    """A validation's metrics from its batches' ``[B]`` rewards and mean generated tokens:
    ``accuracy`` (mean reward), ``num_samples``, ``mean_generated_tokens_per_sample``."""
    all_rewards = torch.cat(rewards)
    return {
        "accuracy": float(all_rewards.mean()),
        "num_samples": float(all_rewards.numel()),
        "mean_generated_tokens_per_sample": sum(lengths) / max(len(lengths), 1),
    }


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

    Colocated generation (``policy.generation.colocated.enabled``) puts the engines on the
    policy's bundles; otherwise they get a cluster of the same shape of their own.
    """
    from transformers import AutoTokenizer

    from nemo_rl.data.dataloader import StatefulPromptLoader
    from nemo_rl.data.datasets import (
        check_prompt_lengths,
        setup_datasets,
        setup_synthetic_sft_dataset,
    )
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
        train, cfg.grpo.prompts_per_generation_batch, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle
    )
    val_batches: list[BatchedDataDict] = []
    if val is not None and (cfg.grpo.val_period or cfg.grpo.val_at_start):
        rows = [val[i] for i in range(min(len(val), cfg.grpo.max_val_samples))]
        size = cfg.grpo.val_batch_size
        val_batches = [rl_collate_fn(rows[i : i + size]) for i in range(0, len(rows), size)]

    sft_loader = None
    if cfg.sft_warmup.enabled:
        sft_set = setup_synthetic_sft_dataset(cfg.data, tokenizer, cfg.sft_warmup.num_samples)
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
        checkpointer=CheckpointManager(cfg.checkpointing) if cfg.checkpointing.enabled else None,
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
    """Policy (model, optimizer, scheduler, RNG), data loader position and driver RNG of
    ``step`` into a new checkpoint folder; the manager keeps the top-k and the latest, ranked
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
    if components.sft_loader is not None and uses_reference_policy(components.cfg):
        warm = Path(components.cfg.checkpointing.checkpoint_dir) / SFT_WARMUP_DIR
        if not warm.is_dir():
            raise FileNotFoundError(
                f"{latest} follows an SFT warm start but {warm} (the warm-started weights, the "
                "run's reference policy) is missing; restore it, or start a new run in an "
                "empty checkpointing.checkpoint_dir"
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


def uses_reference_policy(cfg: GRPOMasterConfig) -> bool:
    """Whether the loss needs reference logprobs (a KL penalty)."""
    return cfg.loss_fn.reference_policy_kl_penalty > 0


def sft_warm_start(components: GRPOComponents) -> None:
    """Run the SFT warm start with its own learning-rate schedule, make the warm-started
    weights the reference policy (the KL penalty anchors to them, not to the random model) and,
    with checkpointing, save them to ``checkpoint_dir/sft_warmup`` so a resumed run can rebuild
    the same reference; then restart the optimizer for GRPO (zero Adam state, the policy's
    schedule from step 0)."""
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
            tmp.rename(final)
    components.policy.reset_optimizer()


def grpo_train(
    components: GRPOComponents,
    step_fn: Callable[[GRPOComponents, Iterator[BatchedDataDict]], dict[str, float]] = grpo_step,
    validate_fn: Callable[[GRPOComponents], dict[str, float]] = validate,
) -> dict[str, float]:
    """Run GRPO from the latest checkpoint (or step 0) to ``grpo.max_num_steps``.

    Args:
        components: what :func:`setup` built.
        step_fn: one training step (the data-plane loop passes its own).
        validate_fn: one validation pass.

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).
    """
    cfg, logger, timer = components.cfg, components.logger, components.timer
    step = restore_latest_checkpoint(components)
    if step == 0 and components.sft_loader is not None:
        sft_warm_start(components)
    last: dict[str, float] = {}
    val_metrics: dict[str, float] = {}
    if cfg.grpo.val_at_start and step == 0 and components.val_batches:
        val_metrics = validate_fn(components)
        logger.log_metrics(val_metrics, step, "validation")
    batches = iter(components.train_loader)
    while step < cfg.grpo.max_num_steps:
        with logger.step_progress(step + 1, cfg.grpo.max_num_steps, timer):
            last = step_fn(components, batches)
        step += 1
        logger.log_metrics(last, step, "train")
        logger.log_metrics(timer.summary(), step, "timing/train")
        timer.reset()
        if cfg.grpo.val_period and step % cfg.grpo.val_period == 0 and components.val_batches:
            val_metrics = validate_fn(components)
            logger.log_metrics(val_metrics, step, "validation")
        if components.checkpointer is not None and (
            step % cfg.checkpointing.save_period == 0 or step == cfg.grpo.max_num_steps
        ):
            save_checkpoint(components, step, val_metrics, last)
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

    from nemo_rl.algorithms.grpo_sync import grpo_train_sync

    components = setup(cfg)
    try:
        final = (grpo_train_sync if cfg.data_plane.enabled else grpo_train)(components)
    finally:
        shutdown(components)
        shutdown_ray()
    log_dir = Path(cfg.logger.log_dir)
    plot = plot_training_curves(components.logger.metrics_path, log_dir / "reward_curve.png")
    print(f"final metrics: { {k: round(v, 4) for k, v in final.items()} }")
    print(f"logs: {log_dir}  plot: {plot}")
    if components.checkpointer is not None:
        print(f"checkpoints: {cfg.checkpointing.checkpoint_dir}")
