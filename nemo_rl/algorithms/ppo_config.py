"""Typed config of a PPO run (``nemo-rl ppo``): the ``ppo`` loop, the policy's clipped
policy-gradient loss (``loss_fn``), the critic (``value``, a policy config with the scalar
head) and its loss (``value_loss_fn``), and the shared sections of a rollout-trained run. Key
names follow NeMo RL's ``examples/configs/ppo_math_1B.yaml``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_bridge import BridgeConfig
from nemo_rl.algorithms.loop_config import (
    check_parallel_layout,
    derive_lr_decay_iters,
    shared_vocabulary,
)
from nemo_rl.algorithms.loss.clipped_pg import ClippedPGLossConfig
from nemo_rl.algorithms.loss.value import MseValueLossConfig
from nemo_rl.algorithms.rollout_config import RolloutLoopConfig, RolloutMasterConfig
from nemo_rl.environments.reward_model_environment import check_reward_model_folder
from nemo_rl.models.generation.config import Precision
from nemo_rl.models.model_path import local_model_path
from nemo_rl.models.policy.config import PolicyConfig, RewardModelConfig
from nemo_rl.utils.config import ConfigModel


class ValueHeadConfig(RewardModelConfig):
    """The critic's scalar head (``value.reward_model_cfg``): always on."""

    enabled: Literal[True] = Field(
        default=True, description="The critic's scalar value head in place of the LM head."
    )


_SHARED_WITH_POLICY = (
    "model_name",
    "max_total_sequence_length",
    "precision",
    "train_global_batch_size",
    "train_micro_batch_size",
    "logprob_batch_size",
)
"""Keys of the ``value`` section that default to the ``policy`` section's."""


def _policy_key(key: str) -> str:
    """The interpolation a ``value`` key defaults to: the ``policy`` section's value."""
    return "${policy." + key + "}"


class ValueConfig(PolicyConfig):
    """The critic (``value``): a policy config with the scalar head forced on; the keys of
    :data:`_SHARED_WITH_POLICY` default to the policy's (``${policy.<key>}``, as NeMo RL's
    recipes write them), so the critic starts from the policy's weights with a fresh head;
    ``init_from_reward_model`` starts it from a reward model's decoder and trained head
    instead."""

    model_name: str = Field(
        default=_policy_key("model_name"),
        min_length=1,
        description="The critic's initial weights (a causal LM; its LM head is replaced by a "
        "fresh scalar head): the policy's model, or a reward model's base. With "
        "init_from_reward_model: that folder (the default; another value is refused).",
    )
    init_from_reward_model: str | None = Field(
        default=None,
        description="A reward model's HF folder (`nemo-rl export` of a `nemo-rl rm` "
        "checkpoint: a ...ForSequenceClassification with one label) to start the critic from: "
        "its decoder and its trained score head, so the critic's value of each state is at "
        "first the reward model's score of the sequence so far. Must share the policy's "
        "tokenizer. None: start from model_name with a fresh head (NeMo RL's only way).",
    )
    max_total_sequence_length: int = Field(
        default=_policy_key("max_total_sequence_length"), ge=2,
        description="Longest prompt + response, in tokens; at least the policy's.",
    )
    precision: Precision = Field(
        default=_policy_key("precision"), description="Parameter and activation dtype."
    )
    train_global_batch_size: int = Field(
        default=_policy_key("train_global_batch_size"), ge=1,
        description="Samples per optimizer step of the critic.",
    )
    train_micro_batch_size: int = Field(
        default=_policy_key("train_micro_batch_size"), ge=1,
        description="Samples per forward/backward pass on one data-parallel rank.",
    )
    logprob_batch_size: int = Field(
        default=_policy_key("logprob_batch_size"), ge=1,
        description="Samples per forward pass when computing values.",
    )
    reward_model_cfg: ValueHeadConfig = Field(
        default_factory=ValueHeadConfig, description="The scalar value head (always on)."
    )


class PPOAdvEstimatorConfig(ConfigModel):
    """How advantages are computed (``ppo.adv_estimator``; NeMo RL's keys): generalized
    advantage estimation over the critic's per-token values
    (:func:`~nemo_rl.algorithms.advantage_estimators.gae_advantages`)."""

    name: Literal["gae"] = Field(default="gae", description="The estimator: 'gae'.")
    gae_gamma: float = Field(
        default=1.0, ge=0.0, le=1.0, description="Discount per token (gamma)."
    )
    gae_lambda: float = Field(
        default=0.95, ge=0.0, le=1.0, description="GAE lambda: 0 one-step TD, 1 Monte Carlo."
    )
    normalize_advantages: bool = Field(
        default=True,
        description="Whiten the advantages over the batch's response tokens (sample variance); "
        "the critic's returns use the unwhitened ones.",
    )
    gae_lambda_value: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="VAPO's decoupled GAE: the lambda of the critic's returns (1.0: Monte "
        "Carlo targets). None: gae_lambda.",
    )
    gae_lambda_policy: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="VAPO's decoupled GAE: the lambda of the policy's advantages. None: "
        "gae_lambda. Ignored when length_adaptive_alpha > 0.",
    )
    length_adaptive_alpha: float = Field(
        default=0.0,
        ge=0.0,
        description="VAPO's length-adaptive lambda of the policy's advantages, per sample "
        "1 - 1 / max(alpha * response tokens, 1) (VAPO: 0.05); the returns keep "
        "gae_lambda_value (or gae_lambda). 0: off.",
    )


class PPOLossConfig(ClippedPGLossConfig):
    """The policy's loss in a PPO run (``loss_fn``): the clipped policy-gradient loss without
    the KL penalty (a PPO run keeps no reference policy)."""

    reference_policy_kl_penalty: float = Field(
        default=0.0,
        ge=0.0,
        description="Must stay 0: a PPO run keeps no reference policy to take a KL to.",
    )


class PPOConfig(RolloutLoopConfig):
    """The PPO loop (``ppo``): the rollout loop's keys (PPO usually samples one response per
    prompt: ``num_generations_per_prompt: 1``), the update epochs per rollout, the critic's
    warm-up and the advantage estimator."""

    ppo_epochs: int = Field(
        default=4,
        ge=1,
        description="Passes over each rollout batch; each trains the critic, then the policy, "
        "on the advantages computed once after the rollout.",
    )
    policy_training_start_step: int = Field(
        default=0,
        ge=0,
        description="Critic-only warm-up: the policy trains from the step after this many "
        "finished steps (0: from the first step); the critic trains at every step.",
    )
    adv_estimator: PPOAdvEstimatorConfig = Field(
        default_factory=PPOAdvEstimatorConfig, description="The advantage estimator (GAE)."
    )


class PPOMasterConfig(RolloutMasterConfig):
    """Everything a PPO run reads; the root of a PPO recipe. ``policy`` is trained with the
    clipped policy-gradient loss; ``value`` is the critic, the same Megatron policy with the
    scalar head in place of the LM head, on the policy's bundles."""

    ppo: PPOConfig = Field(default_factory=PPOConfig, description="PPO loop settings.")
    loss_fn: PPOLossConfig = Field(
        default_factory=PPOLossConfig, description="The policy's clipped policy-gradient loss."
    )
    value: ValueConfig = Field(
        default_factory=ValueConfig,
        description="The critic: a policy config whose scalar head (reward_model_cfg.enabled) "
        "is forced on; model_name, max_total_sequence_length, precision and the batch sizes "
        "default to the policy's (the critic starts from the policy's weights with a fresh "
        "head, or from a reward model's decoder and head with init_from_reward_model); its own "
        "optimizer and scheduler (the defaults, not the policy's); its "
        "generation keys are unused.",
    )
    value_loss_fn: MseValueLossConfig = Field(
        default_factory=MseValueLossConfig, description="The critic's clipped value loss."
    )

    @property
    def loop(self) -> PPOConfig:
        """The ``ppo`` section."""
        return self.ppo

    @model_validator(mode="before")
    @classmethod
    def _derive_value_and_loss(cls, data: Any) -> Any:
        """The critic's keys of :data:`_SHARED_WITH_POLICY` that are absent or still
        ``${policy.<key>}`` (a config validated without interpolation) take the policy's
        values; ``model_name`` left at the policy's becomes ``init_from_reward_model`` when
        that is set."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        policy = data.get("policy") or {}
        policy = policy.model_dump() if isinstance(policy, PolicyConfig) else dict(policy)
        value = data.get("value") or {}
        value = value.model_dump(exclude_unset=True) if isinstance(value, PolicyConfig) else dict(value)
        reward_model = value.get("init_from_reward_model")
        if reward_model is not None:
            given = value.get("model_name", _policy_key("model_name"))
            policy_model = policy.get("model_name", PolicyConfig.model_fields["model_name"].default)
            # left at the policy's (loaders resolve the default's interpolation first)
            if given not in (_policy_key("model_name"), policy_model, reward_model):
                raise ValueError(
                    f"value.model_name ({given}) and value.init_from_reward_model "
                    f"({reward_model}) name two starting points of the critic; drop "
                    "value.model_name (it becomes the reward model)"
                )
            value["model_name"] = reward_model
        for key in _SHARED_WITH_POLICY:
            if value.get(key, _policy_key(key)) == _policy_key(key):
                value[key] = policy.get(key, PolicyConfig.model_fields[key].default)
        data["value"] = value
        return data

    @model_validator(mode="after")
    def _derive_and_check(self) -> PPOMasterConfig:
        """The shared checks, the learning-rate horizons of both models (``ppo_epochs`` passes
        per step), and what PPO needs of the losses and the critic."""
        ppo = self.ppo
        samples = ppo.num_prompts_per_step * ppo.num_generations_per_prompt
        for name, cfg in (("policy", self.policy), ("value", self.value)):
            if samples % cfg.train_global_batch_size:
                raise ValueError(
                    f"ppo.num_prompts_per_step * ppo.num_generations_per_prompt ({samples}) "
                    f"must be a multiple of {name}.train_global_batch_size "
                    f"({cfg.train_global_batch_size})"
                )
        policy_steps = ppo.ppo_epochs * samples // self.policy.train_global_batch_size
        trained_steps = max(ppo.max_num_steps - ppo.policy_training_start_step, 1)
        derive_lr_decay_iters(self.policy, trained_steps * policy_steps, "ppo.max_num_steps")
        value_steps = ppo.ppo_epochs * samples // self.value.train_global_batch_size
        derive_lr_decay_iters(self.value, ppo.max_num_steps * value_steps, "ppo.max_num_steps")
        self.check_rollout_run("ppo", "val_accuracy", "train_loss")
        check_parallel_layout(self.value, self.cluster)
        self._check_critic_start()
        if self.value.max_total_sequence_length < self.policy.max_total_sequence_length:
            raise ValueError(
                f"value.max_total_sequence_length ({self.value.max_total_sequence_length}) "
                f"must be >= policy.max_total_sequence_length "
                f"({self.policy.max_total_sequence_length}): the critic scores every rollout"
            )
        if self.value.megatron_cfg.peft.enabled:
            raise ValueError(
                "value.megatron_cfg.peft.enabled: the critic's new value head must be trained "
                "in full, which LoRA does not do; disable it"
            )
        loss = self.loss_fn
        if loss.reference_policy_kl_penalty != 0 or loss.use_kl_in_reward:
            raise ValueError(
                "loss_fn.reference_policy_kl_penalty / loss_fn.use_kl_in_reward: a PPO run keeps "
                "no reference policy; set loss_fn.reference_policy_kl_penalty=0 and "
                "loss_fn.use_kl_in_reward=false"
            )
        if loss.force_on_policy_ratio and policy_steps > 1:
            raise ValueError(
                f"loss_fn.force_on_policy_ratio is only right with one optimizer step per "
                f"rollout, and this run takes {policy_steps} (ppo.ppo_epochs x samples / "
                "policy.train_global_batch_size); set it to false"
            )
        return self

    def _check_critic_start(self) -> None:
        """``value.init_from_reward_model`` is a reward model's folder (and ``value.model_name``
        is one only through it: a reward model there would otherwise lose its trained head);
        the critic reads the policy's token ids, so the two share a tokenizer (checked when
        both are here without a download)."""
        field = "value.model_name"
        if self.value.init_from_reward_model is not None:
            field = "value.init_from_reward_model"
            check_reward_model_folder(self.value.init_from_reward_model, field)
        else:
            path = local_model_path(self.value.model_name)
            if path is not None and BridgeConfig.from_hf(path).is_sequence_classifier:
                raise ValueError(
                    f"value.model_name={self.value.model_name!r} is a sequence classifier; to "
                    "start the critic from a reward model (its decoder and trained score head) "
                    f"set value.init_from_reward_model={self.value.model_name!r} instead"
                )
        if self.value.model_name == self.policy.model_name:
            return  # the policy's own model
        shared_vocabulary(
            self.policy.model_name,
            self.value.model_name,
            field,
            "the critic scores the policy's token ids: start it from a model with the "
            "policy's tokenizer",
        )
