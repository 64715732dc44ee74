"""Stopping a GRPO run whose environments keep failing.

A failing environment scores its samples 0 and the run goes on (one flaky call must not end a
long run), but a run where most samples fail in step after step learns nothing while it looks
healthy: :func:`check_env_errors` stops it with the environment's first error.
"""

from __future__ import annotations

from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.experience.grouped_rollouts import RolloutCarry
from nemo_rl.utils.errors import InputError


class EnvironmentFailureError(InputError, RuntimeError):
    """The environments failed on too many samples for too many steps."""


def check_env_errors(carry: RolloutCarry, cfg: GRPOConfig, streak: int) -> int:
    """The new count of consecutive steps over ``grpo.max_env_error_rate``, after a step whose
    rollouts are ``carry`` (metric ``env_error_rate``: the share of samples whose environment
    failed), ``streak`` being the count before it.

    Raises:
        EnvironmentFailureError: the count reached ``grpo.env_error_patience``; the message names
            the first failing environment of the step, its error and the keys to change.
    """
    rate = carry.metrics["env_error_rate"]
    if rate <= cfg.max_env_error_rate:
        return 0
    streak += 1
    if streak >= cfg.env_error_patience:
        raise EnvironmentFailureError(
            f"the environments failed on {rate:.0%} of this step's samples, more than "
            f"grpo.max_env_error_rate={cfg.max_env_error_rate:g} in each of the last {streak} "
            f"steps (grpo.env_error_patience={cfg.env_error_patience}); first error: "
            f"{carry.first_env_error}. Fix the environment or the fields its data rows carry "
            "(grpo.max_env_error_rate=1.0 never stops)"
        )
    return streak
