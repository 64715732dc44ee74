"""What a run trained on rollouts holds (:class:`RolloutComponents`; GRPO's
:class:`GRPOComponents`, built by :func:`nemo_rl.algorithms.grpo.setup`) and the engines' lazy
refit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig, RolloutMasterConfig
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.grouped_rollouts import RolloutRunner
from nemo_rl.models.generation.refit import refit_policy_generation


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


@dataclass
class GRPOComponents(RolloutComponents):
    """Everything a GRPO run holds.

    Attributes:
        sft_loader: batches of the SFT warm start (None when ``sft_warmup`` is off).
        env_error_streak: consecutive steps whose environments failed on more than
            ``grpo.max_env_error_rate`` of the samples (:func:`check_env_errors`).
    """

    cfg: GRPOMasterConfig
    loss_fn: ClippedPGLossFn
    sft_loader: Optional[Any] = None
    env_error_streak: int = 0


def prepare_generation(components: RolloutComponents) -> None:
    """Refit the engines if the policy changed since their last update, and wake them."""
    colocated = components.cfg.policy.generation.colocated.enabled
    if components.generation_stale:
        refit_policy_generation(components.policy, components.generation, colocated)
        components.generation_stale = False
        if colocated:
            return  # a colocated refit wakes the engines to load the weights into them
    components.generation.prepare_for_generation()


def uses_reference_policy(cfg: GRPOMasterConfig) -> bool:
    """Whether the loss needs reference logprobs (a KL penalty)."""
    return cfg.loss_fn.reference_policy_kl_penalty > 0
