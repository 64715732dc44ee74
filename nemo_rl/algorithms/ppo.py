"""PPO with a value model: the ``nemo-rl ppo`` command.

The policy samples responses with vLLM; a critic (``value``: the policy's architecture with a
scalar head, started from the policy's weights with a fresh head or from a reward model's
decoder and trained head, ``value.init_from_reward_model``; colocated on the policy's bundles
with its own optimizer) gives every response token a value; generalized advantage estimation turns the
outcome rewards and the values into per-token advantages and returns. One step
(:func:`ppo_step`), phase by phase, with GRPO's pieces:

1. **generate**: ``num_prompts_per_step`` prompts, ``num_generations_per_prompt`` responses
   each (usually 1), after the engines took the policy's latest weights
   (:func:`~nemo_rl.algorithms.grpo_step.step.rollout_groups`); the environments score them.
2. **values**: the critic's ``values`` ``[B, S]`` (the state before each token).
3. **logprobs**: the policy's before the update (``prev_logprobs``).
4. **advantages**: :func:`~nemo_rl.algorithms.advantage_estimators.gae_advantages` with
   ``ppo.adv_estimator``'s ``gae_gamma`` / ``gae_lambda`` / ``normalize_advantages`` (and
   VAPO's decoupled lambdas, :func:`gae_lambdas`) over the response tokens of the samples the
   loss keeps: ``advantages`` and ``returns`` ``[B, S]``.
5. **train**, ``ppo.ppo_epochs`` times on the same batch: the critic on the value loss
   (:class:`~nemo_rl.algorithms.loss.MseValueLossFn`, ``value_loss_fn``), then, once
   ``ppo.policy_training_start_step`` steps have finished, the policy on the clipped
   policy-gradient loss (``loss_fn``). The critic's state then leaves the device until the
   next step's values (offloaded while the engines generate).
6. **refit**: when the policy trained, the engines are marked stale; they take the new weights
   before their next generation.

Validation, exact resume and the stop rule are the shared loop's
(:mod:`nemo_rl.algorithms.training_loop`); the critic's checkpoint (model, optimizer,
scheduler, step) is saved in each checkpoint's ``value/`` folder next to ``policy/`` and
restored with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl.algorithms.advantage_estimators import gae_advantages, length_adaptive_lambda
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.metrics import step_metrics
from nemo_rl.algorithms.grpo_step.step import rollout_groups
from nemo_rl.algorithms.loss import ClippedPGLossFn, MseValueLossFn
from nemo_rl.algorithms.loss.value import explained_variance
from nemo_rl.algorithms.ppo_config import PPOAdvEstimatorConfig, PPOMasterConfig
from nemo_rl.algorithms.rollout_command import run_in_memory, start_with_second_model
from nemo_rl.algorithms.rollout_run import RolloutComponents
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

VALUE_DIR = "value"
"""The critic's subfolder of a checkpoint (next to the policy's ``policy/``)."""
CURVES = (("train", "reward"), ("validation", "accuracy"))
"""The curves of the run's ``reward_curve.png``."""


@dataclass
class PPOComponents(RolloutComponents):
    """Everything a PPO run holds: a rollout-trained run's parts and the critic.

    Attributes:
        value: the critic, a :class:`~nemo_rl.models.policy.lm_policy.Policy` with the scalar
            head.
        value_loss_fn: the critic's loss.
        steps_done: PPO steps finished (restored on resume); the policy trains once it reaches
            ``ppo.policy_training_start_step``.
    """

    cfg: PPOMasterConfig
    loss_fn: ClippedPGLossFn
    value_loss_fn: MseValueLossFn | None = None
    value: Any = None
    steps_done: int = 0

    def checkpointed_models(self) -> dict[str, Any]:
        """The critic, saved in and restored from each checkpoint's ``value/``."""
        return {VALUE_DIR: self.value}

    def train_step(self, store: InMemoryBatchStore, batches: Any) -> dict[str, float]:
        """One PPO step (:func:`ppo_step`): the shared loop's step function."""
        return ppo_step(self, store, batches)

    def resumed(self, step: int) -> None:
        """The run resumed after ``step`` finished steps (the critic's warm-up counts them)."""
        self.steps_done = step


def setup(cfg: PPOMasterConfig) -> PPOComponents:
    """The policy's run and the critic's workers (with their optimizer) on the policy's
    bundles (:func:`~nemo_rl.algorithms.rollout_command.start_with_second_model`).

    Raises:
        ConfigError: before anything starts, when the latest checkpoint was trained on another
            model or data than ``cfg`` names.
    """
    parts, value = start_with_second_model(cfg, cfg.value, "value", trained=True)
    return PPOComponents(
        cfg=cfg,
        loss_fn=ClippedPGLossFn(cfg.loss_fn),
        value_loss_fn=MseValueLossFn(cfg.value_loss_fn),
        value=value,
        **parts,
    )


def gae_lambdas(
    est: PPOAdvEstimatorConfig, mask: torch.Tensor
) -> tuple[float | torch.Tensor, float | None]:
    """GAE's lambdas as NeMo RL resolves ``ppo.adv_estimator``: the policy's advantages take
    the length-adaptive ``[B]`` lambdas of the ``[B, S]`` loss ``mask`` when
    ``length_adaptive_alpha > 0``, else ``gae_lambda_policy``, else ``gae_lambda``; the
    critic's returns take ``gae_lambda_value``, else ``gae_lambda`` (None when that is the
    policy's: one GAE pass)."""
    if est.length_adaptive_alpha > 0:
        policy: float | torch.Tensor = length_adaptive_lambda(mask, est.length_adaptive_alpha)
    elif est.gae_lambda_policy is not None:
        policy = est.gae_lambda_policy
    else:
        policy = est.gae_lambda
    value = est.gae_lambda_value if est.gae_lambda_value is not None else est.gae_lambda
    return policy, None if isinstance(policy, float) and policy == value else value


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """NeMo RL's ``advantages/mean``, ``advantages/max``, ``advantages/min`` of the ``[B, S]``
    advantages over the tokens of the ``[B, S]`` loss ``mask`` (0 without any)."""
    on = advantages[mask > 0]
    if not on.numel():
        return {"advantages/mean": 0.0, "advantages/max": 0.0, "advantages/min": 0.0}
    mean, high, low = torch.stack([on.mean(), on.max(), on.min()]).tolist()
    return {"advantages/mean": mean, "advantages/max": high, "advantages/min": low}


def add_gae_fields(
    components: PPOComponents,
    store: InMemoryBatchStore,
    batch: BatchedDataDict,
    rewards: torch.Tensor,
    sample_mask: torch.Tensor,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """``batch`` with the critic's ``values``, GAE's ``advantages`` and ``returns`` ``[B, S]``
    from the ``[B]`` ``rewards`` (over the response tokens of the samples ``sample_mask``
    ``[B]`` keeps), ``sample_mask`` and, with ``loss_fn.positive_example_nll_weight > 0``,
    ``rewards``; and the advantages' :func:`advantage_metrics`."""
    est = components.cfg.ppo.adv_estimator
    values = components.value.get_values(batch)["values"].float()
    mask = batch["token_mask"].float() * sample_mask[:, None]
    policy_lambda, value_lambda = gae_lambdas(est, mask)
    advantages, returns = gae_advantages(
        rewards.float(),
        values,
        mask,
        gamma=est.gae_gamma,
        lam=policy_lambda,
        normalize_advantages=est.normalize_advantages,
        value_lam=value_lambda,
    )
    fields = {"values": values, "advantages": advantages, "returns": returns, "sample_mask": sample_mask}
    if components.cfg.loss_fn.positive_example_nll_weight > 0:
        fields["rewards"] = rewards.float()  # VAPO's NLL trains on the samples with reward > 0
    return store.add_fields(batch, fields), advantage_metrics(advantages, mask)


def critic_metrics(value_results: dict[str, Any]) -> dict[str, float]:
    """The critic's figures of its last optimizer step under NeMo RL's ``critic/`` names:
    ``loss``, ``grad_norm``, ``lr``, the value loss's metrics (``vf_clipfrac``,
    ``values_mean``, ``returns_mean``, ...) and ``explained_var``."""
    metrics = {f"critic/{key}": float(values[-1]) for key, values in value_results["metrics"].items()}
    for key in ("loss", "grad_norm", "lr"):
        metrics[f"critic/{key}"] = float(value_results[key][-1])
    last = {key[len("critic/"):]: value for key, value in metrics.items()}
    metrics["critic/explained_var"] = explained_variance(last)
    return metrics


def ppo_step(
    components: PPOComponents, store: InMemoryBatchStore, batches: Any
) -> dict[str, float]:
    """One PPO step on the next prompts of ``batches`` (see the module docstring); returns its
    metrics: the policy's ``loss``, ``grad_norm``, ``lr`` and loss metrics (absent during the
    critic's warm-up), ``reward``, the rollout's ``rollout/*`` figures, the critic's
    ``critic/*`` (:func:`critic_metrics`) and ``advantages/*`` (:func:`advantage_metrics`)."""
    cfg, timer, policy, value = components.cfg, components.timer, components.policy, components.value
    group_size = cfg.ppo.num_generations_per_prompt
    trains_policy = components.steps_done >= cfg.ppo.policy_training_start_step
    with store.scope("train", cfg.ppo.num_prompts_per_step * group_size, group_size):
        # generate: rollouts, scored by the environments as they go
        batch, carry = rollout_groups(components, store, next(batches))

        # values: the critic's state back on the device
        value.prepare_for_training()
        with timer.time("value_inference"):
            batch, adv_metrics = add_gae_fields(
                components, store, batch, carry.rewards, carry.loss_multiplier.float()
            )

        # logprobs: the policy's before the update
        policy.prepare_for_training()
        with timer.time("policy_logprobs"):
            batch = store.logprobs(batch)

        # train: critic first, then the policy, ppo_epochs times on the same advantages
        train_results: dict[str, Any] = {}
        for _ in range(cfg.ppo.ppo_epochs):
            with timer.time("value_training"):
                value_results = value.train(batch, components.value_loss_fn)
            if trains_policy:
                with timer.time("policy_training"):
                    train_results = store.train(batch, components.loss_fn)
        value.offload_before_refit()
        value.offload_after_refit()
        policy.finish_training()

        # refit: the engines take the new weights before their next generation
        components.generation_stale = components.generation_stale or trains_policy
        store.release(batch)
    components.steps_done += 1
    metrics = {**critic_metrics(value_results), **adv_metrics}
    if trains_policy:
        metrics.update(step_metrics(carry.metrics, train_results, {}))
    else:
        metrics["reward"] = carry.metrics["reward_mean"]
        metrics.update({f"rollout/{k}": v for k, v in carry.metrics.items()})
    return metrics


def run(cfg: PPOMasterConfig) -> int | None:
    """``nemo-rl ppo``: set up, train in the shared loop from the resumed checkpoint (policy
    and critic) to ``ppo.max_num_steps``
    (:func:`~nemo_rl.algorithms.rollout_command.run_in_memory`), print where logs and
    checkpoints are, stop the critic and the rest.

    Returns:
        None when the run finished; 75 when it saved and stopped early.
    """
    components = setup(cfg)
    return run_in_memory(
        components, components.train_step, [components.value], CURVES, components.resumed
    )
