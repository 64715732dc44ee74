"""What a GRPO run holds (:class:`GRPOComponents`, built by
:func:`nemo_rl.algorithms.grpo.setup`: a :class:`~nemo_rl.algorithms.rollout_run.
RolloutComponents` with GRPO's loss and warm start) and the engines' lazy refit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.algorithms.rollout_run import RolloutComponents
from nemo_rl.models.generation.refit import refit_policy_generation


@dataclass
class GRPOComponents(RolloutComponents):
    """Everything a GRPO run holds.

    Attributes:
        sft_loader: batches of the SFT warm start (None when ``sft_warmup`` is off).
        env_error_streak: consecutive steps whose environments failed on more than
            ``grpo.max_env_error_rate`` of the samples (:func:`check_env_errors`).
        engine_restarts_logged: engine restarts already counted in a step's
            ``generation/engine_restarts``.
    """

    cfg: GRPOMasterConfig
    loss_fn: ClippedPGLossFn
    sft_loader: Optional[Any] = None
    env_error_streak: int = 0
    engine_restarts_logged: int = 0


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
