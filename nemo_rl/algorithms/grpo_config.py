"""Typed config of a GRPO run: the master config and its GRPO sections (the ``grpo`` loop,
its advantage estimator and async mode).

The sections every rollout-trained recipe shares (policy, data, env, cluster, logger,
checkpointing) and the rollout loop's keys are :mod:`nemo_rl.algorithms.rollout_config`'s. The
defaults describe a tiny CPU run (8 prompts x 4 generations on a tiny model); recipes in
``configs/`` state only what they choose. Key names follow NeMo RL's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nemo_rl.algorithms.loop_config import plan_gpu_memory
from nemo_rl.algorithms.loss.clipped_pg import ClippedPGLossConfig
from nemo_rl.algorithms.rollout_config import (
    RolloutLoopConfig,
    RolloutMasterConfig,
    train_tasks,
)
from nemo_rl.algorithms.sft import SFTWarmupConfig
from nemo_rl.data.synthetic import SYNTHETIC_ARITHMETIC
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.distributed.memory_plan import MemoryPlan, NoMemoryPlan
from nemo_rl.utils.config import ConfigModel


class AdvEstimatorConfig(ConfigModel):
    """How advantages are computed from the rewards (``grpo.adv_estimator``; NeMo RL's keys).

    ``grpo``: reward minus the group baseline, divided by the group's std when
    ``normalize_rewards``. ``rloo``: reward minus the mean of the other responses to the same
    prompt, not normalised (GRPO with ``use_leave_one_out_baseline: true, normalize_rewards:
    false``). ``gdpo``: several named rewards per sample (``reward/<name>``), each normalised
    within its group like grpo, summed with ``reward_weights`` and whitened over the batch.
    ``reinforce_plus_plus``: reward minus the group mean when ``minus_baseline``, whitened over
    all loss tokens of the batch.
    """

    name: Literal["grpo", "rloo", "gdpo", "reinforce_plus_plus"] = Field(
        default="grpo",
        description="The estimator: 'grpo', 'rloo', 'gdpo' (several rewards per sample) or "
        "'reinforce_plus_plus'.",
    )
    normalize_rewards: bool | None = Field(
        default=None,
        description="grpo, gdpo: divide by the group's reward std (gdpo: per reward). None: "
        "grpo.normalize_rewards.",
    )
    use_leave_one_out_baseline: bool | None = Field(
        default=None,
        description="grpo, gdpo: baseline = mean reward of the other responses of the prompt. "
        "None: grpo.use_leave_one_out_baseline.",
    )
    reward_weights: list[float] | None = Field(
        default=None,
        description="gdpo: weight of each reward's normalised advantage in their sum, one per "
        "reward in the sorted order of the reward/<name> keys. None: 1 each.",
    )
    minus_baseline: bool = Field(
        default=True,
        description="reinforce_plus_plus: subtract the group's mean reward before the batch "
        "whitening (REINFORCE++-baseline).",
    )

    @model_validator(mode="after")
    def _weights_need_gdpo(self) -> AdvEstimatorConfig:
        if self.reward_weights is not None and self.name != "gdpo":
            raise ValueError(
                f"reward_weights weigh GDPO's rewards, but name is {self.name!r}; set name "
                "'gdpo' or remove reward_weights"
            )
        return self


class AsyncGRPOConfig(ConfigModel):
    """Async GRPO (``grpo.async_grpo``; NeMo RL's keys): generation runs ahead of training on
    its own engines (:mod:`nemo_rl.algorithms.grpo_step.async_grpo`)."""

    enabled: bool = Field(
        default=False,
        description="Generate the next steps' rollouts while the policy trains (needs "
        "policy.generation.colocated.enabled=false).",
    )
    max_trajectory_age_steps: int = Field(
        default=1,
        ge=0,
        description="Most training steps between the weights that generated a trajectory and "
        "the step that trains on it; older ones are dropped (metric "
        "async/stale_groups_dropped). 0: every step trains on its own weights' rollouts (the "
        "synchronous loop's order).",
    )
    rollout_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Seconds one generation batch (rollout and environments) may take; a "
        "slower one is abandoned and its prompts skipped (metric async/timed_out_rollouts) "
        "so one hung rollout cannot stall the buffer.",
    )


class GRPOConfig(RolloutLoopConfig):
    """The GRPO loop (``grpo``): the rollout loop's keys plus advantages, dynamic sampling,
    overlong filtering and the environment-error stop."""

    normalize_rewards: bool = Field(
        default=True,
        description="Divide each group's advantages by the group's reward standard deviation.",
    )
    use_leave_one_out_baseline: bool = Field(
        default=True,
        description="Baseline each response by the mean reward of the other responses of its "
        "prompt instead of the whole group's mean; needs num_generations_per_prompt >= 2.",
    )
    adv_estimator: AdvEstimatorConfig = Field(
        default_factory=AdvEstimatorConfig,
        description="The advantage estimator (grpo, rloo, reinforce_plus_plus) and its "
        "settings; its grpo settings default to normalize_rewards and "
        "use_leave_one_out_baseline above.",
    )
    use_dynamic_sampling: bool = Field(
        default=False,
        description="Dynamic sampling (DAPO): drop prompt groups whose responses all got the "
        "same reward (no GRPO signal) and generate from further prompts until "
        "num_prompts_per_step groups with reward variance are collected.",
    )
    batch_multiplier: float = Field(
        default=1.0,
        ge=1.0,
        description="With dynamic sampling, each generation batch holds "
        "num_prompts_per_step x batch_multiplier prompts (rounded to an integer).",
    )
    dynamic_sampling_max_gen_batches: int = Field(
        default=10,
        ge=1,
        description="With dynamic sampling, generation batches tried per step before the step "
        "fails with an error (too few prompts with reward variance).",
    )
    overlong_filtering: bool = Field(
        default=False,
        description="Keep responses cut by a token limit (max_new_tokens or "
        "policy.max_total_sequence_length) out of the loss; they still count in their group's "
        "baseline.",
    )
    max_env_error_rate: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="Stop the run (exit 2, naming the environment and its first error) when "
        "more than this share of a step's samples had a failing environment (raised, timed "
        "out, wrong answer shape) in env_error_patience consecutive steps; failed samples "
        "score 0. 1.0 never stops.",
    )
    env_error_patience: int = Field(
        default=3,
        ge=1,
        description="Consecutive steps over max_env_error_rate that stop the run.",
    )
    async_grpo: AsyncGRPOConfig = Field(
        default_factory=AsyncGRPOConfig,
        description="Async GRPO: rollouts generated ahead of training, at most "
        "max_trajectory_age_steps old.",
    )

    @property
    def prompts_per_generation_batch(self) -> int:
        """Prompts the data loader yields per generation batch."""
        if not self.use_dynamic_sampling:
            return self.num_prompts_per_step
        return max(self.num_prompts_per_step, round(self.num_prompts_per_step * self.batch_multiplier))

    @model_validator(mode="after")
    def _resolve_estimator(self) -> GRPOConfig:
        """Fill ``adv_estimator``'s grpo settings from the top-level keys (NeMo RL has both)
        and check they agree and fit the group size."""
        est = self.adv_estimator
        if est.name == "rloo":
            if est.normalize_rewards or est.use_leave_one_out_baseline is False:
                raise ValueError(
                    "adv_estimator.name 'rloo' is a leave-one-out baseline without "
                    f"normalisation, but adv_estimator sets normalize_rewards="
                    f"{est.normalize_rewards}, use_leave_one_out_baseline="
                    f"{est.use_leave_one_out_baseline}; remove them or use name 'grpo'"
                )
            est.normalize_rewards, est.use_leave_one_out_baseline = False, True
        for key in ("normalize_rewards", "use_leave_one_out_baseline"):
            mine, top = getattr(est, key), getattr(self, key)
            if mine is None:
                setattr(est, key, top)
            elif est.name == "grpo" and mine != top and key in self.model_fields_set:
                raise ValueError(
                    f"grpo.{key} ({top}) and grpo.adv_estimator.{key} ({mine}) disagree; set "
                    "one of them"
                )
        if (
            est.name != "reinforce_plus_plus"
            and est.use_leave_one_out_baseline
            and self.num_generations_per_prompt < 2
        ):
            raise ValueError(
                "use_leave_one_out_baseline needs num_generations_per_prompt >= 2 "
                f"(got {self.num_generations_per_prompt}); set one of them differently"
            )
        return self


class GRPOMasterConfig(RolloutMasterConfig):
    """Everything a GRPO run reads; the root of a GRPO recipe."""

    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO loop settings.")
    loss_fn: ClippedPGLossConfig = Field(
        default_factory=ClippedPGLossConfig, description="Policy-gradient loss settings."
    )
    data_plane: DataPlaneConfig = Field(
        default_factory=DataPlaneConfig,
        description="Data plane of the GRPO loop; enabled: the driver carries metadata only.",
    )
    sft_warmup: SFTWarmupConfig = Field(
        default_factory=SFTWarmupConfig,
        description="Supervised warm start before the first GRPO step (the synthetic task's "
        "replies, or sft_warmup.train_path's demonstrations).",
    )

    @property
    def loop(self) -> GRPOConfig:
        """The ``grpo`` section."""
        return self.grpo

    def _check_kl_in_reward(self) -> None:
        """``loss_fn.use_kl_in_reward`` puts a per-token KL into REINFORCE++'s rewards: it
        needs that estimator, the policy's logprobs before the update, and the step's batch
        on the driver (NeMo RL's grpo estimator would silently drop the KL)."""
        if not self.loss_fn.use_kl_in_reward:
            return
        fixes = {
            "grpo.adv_estimator.name=reinforce_plus_plus (only REINFORCE++ takes a per-token "
            "reward)": self.grpo.adv_estimator.name != "reinforce_plus_plus",
            "loss_fn.force_on_policy_ratio=false (the KL reads the policy's logprobs, whose "
            "pass it skips)": self.loss_fn.force_on_policy_ratio,
            "data_plane.enabled=false (the per-token advantages are made on the driver)": (
                self.data_plane.enabled
            ),
        }
        needed = [fix for fix, broken in fixes.items() if broken]
        if needed:
            raise ValueError("loss_fn.use_kl_in_reward=true needs " + "; ".join(needed))

    def _check_gdpo(self) -> None:
        """GDPO needs every training task's environment to return two or more named rewards,
        as many as ``reward_weights`` has weights (checked where the environment declares
        them; otherwise at the first step)."""
        est = self.grpo.adv_estimator
        if est.name != "gdpo":
            return
        specs = self.env.specs()
        for field, task in train_tasks(self.data).items():
            components = specs[task].reward_components
            if components is None:
                continue
            if len(components) < 2:
                gives = f"rewards {list(components)}" if components else "one reward"
                raise ValueError(
                    f"grpo.adv_estimator.name=gdpo needs two or more rewards per sample, but "
                    f"env.{task} ({field}) gives {gives}; train on a task with several "
                    "(a plug-in section with reward_fns: {name: 'package.module:function', "
                    "...}, or an environment class declaring reward_components) or use "
                    "grpo.adv_estimator.name=grpo"
                )
            weights = est.reward_weights
            if weights is not None and len(weights) != len(components):
                raise ValueError(
                    f"grpo.adv_estimator.reward_weights has {len(weights)} weights but env."
                    f"{task} gives {len(components)} rewards {list(components)}; give one "
                    "weight per reward, in that (sorted) order"
                )

    @model_validator(mode="after")
    def _derive_and_check(self) -> GRPOMasterConfig:
        """Check constraints spanning sections, then fill the fields documented "None: X"."""
        self.check_rollout_run("grpo", "val_reward", "train_reward")
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if self.loss_fn.force_on_policy_ratio and samples != self.policy.train_global_batch_size:
            raise ValueError(
                f"loss_fn.force_on_policy_ratio needs exactly one optimizer step per rollout "
                f"(the step then skips the logprob pass: the weights that generated are the "
                f"ones trained): set policy.train_global_batch_size to grpo.num_prompts_per_step"
                f" * grpo.num_generations_per_prompt ({samples}), got "
                f"{self.policy.train_global_batch_size}"
            )
        self._check_kl_in_reward()
        self._check_gdpo()
        self._check_async()
        if self.sft_warmup.global_batch_size is None:
            self.sft_warmup.global_batch_size = self.policy.train_global_batch_size
        warmup = self.sft_warmup
        if warmup.enabled and warmup.train_path is None and not self.data.uses_synthetic:
            raise ValueError(
                f"sft_warmup.enabled needs demonstrations: set sft_warmup.train_path to a file "
                f"of prompts and replies, or train on the synthetic task's rows (data."
                f"dataset_name={SYNTHETIC_ARITHMETIC!r} without data.train_path, the only task "
                f"with built-in replies); got dataset_name={self.data.dataset_name!r}, "
                f"train_path={self.data.train_path!r}"
            )
        self.memory_plan().check()
        return self

    def memory_plan(self) -> MemoryPlan | NoMemoryPlan:
        """The run's per-GPU memory plan: the policy's training and its vLLM engines."""
        return plan_gpu_memory(self.policy, self.cluster, with_generation=True)

    def _check_async(self) -> None:
        """Async GRPO needs engines of its own, the in-memory loop, one generation batch per
        step, and, with trajectories older than the weights they train, the mismatch weight."""
        a = self.grpo.async_grpo
        if not a.enabled:
            return
        conflicts = [
            (self.policy.generation.colocated.enabled, "policy.generation.colocated.enabled=false "
             "(the engines generate while the policy trains: they need their own resources)"),
            (self.data_plane.enabled, "data_plane.enabled=false (async rollouts pass through "
             "driver memory)"),
            (self.grpo.use_dynamic_sampling, "grpo.use_dynamic_sampling=false (one generation "
             "batch per step)"),
            (a.max_trajectory_age_steps > 0 and self.loss_fn.force_on_policy_ratio,
             "loss_fn.force_on_policy_ratio=false or grpo.async_grpo.max_trajectory_age_steps=0 "
             "(older trajectories are not on-policy)"),
            (a.max_trajectory_age_steps > 0 and not self.loss_fn.use_importance_sampling_correction,
             "loss_fn.use_importance_sampling_correction=true or grpo.async_grpo."
             "max_trajectory_age_steps=0 (the mismatch weight corrects for the older weights "
             "that generated)"),
        ]
        for bad, fix in conflicts:
            if bad:
                raise ValueError(f"grpo.async_grpo.enabled needs {fix}")
