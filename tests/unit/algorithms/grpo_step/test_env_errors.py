"""A run whose environments keep failing stops, naming the environment and its first error."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.algorithms.grpo_step.env_errors import EnvironmentFailureError, check_env_errors
from nemo_rl.experience.grouped_rollouts import RolloutCarry
from nemo_rl.utils.errors import InputError

ERROR = "environment 'number_guess': KeyError('secret')"


def carry(rate: float) -> RolloutCarry:
    zeros = torch.zeros(4)
    return RolloutCarry(
        group_ids=zeros.long(), rewards=zeros, loss_multiplier=zeros, truncated=zeros.bool(),
        response_truncated=zeros.bool(), response_tokens=zeros.long(),
        metrics={"env_error_rate": rate}, sampling_step=0,
        first_env_error=ERROR if rate > 0 else None,
    )


def test_streak_counts_consecutive_steps_over_the_rate_and_stops_at_the_patience() -> None:
    cfg = GRPOConfig(max_env_error_rate=0.5, env_error_patience=3)
    streak = 0
    for rate, want in [(1.0, 1), (0.75, 2), (0.5, 0), (1.0, 1), (0.6, 2)]:
        streak = check_env_errors(carry(rate), cfg, streak)
        assert streak == want
    with pytest.raises(EnvironmentFailureError) as info:
        check_env_errors(carry(1.0), cfg, streak)
    message = str(info.value)
    assert ERROR in message and "100% of this step's samples" in message
    assert "grpo.max_env_error_rate=0.5" in message and "grpo.env_error_patience=3" in message
    assert isinstance(info.value, InputError)  # the CLI reports it in one line, exit 2


def test_rate_one_never_stops() -> None:
    cfg = GRPOConfig(max_env_error_rate=1.0, env_error_patience=1)
    assert check_env_errors(carry(1.0), cfg, 0) == 0
