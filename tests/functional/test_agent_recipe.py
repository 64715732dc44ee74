"""The agent recipe (configs/grpo_agent_calculator_tiny_cpu.yaml) from the CLI, two GRPO steps
after a short warm start: every episode runs through the calculator agent over the engine's
HTTP endpoint (on 127.0.0.1) without an environment error, and the first step is on-policy
(the trained tokens and logprobs are the engine's own: ratio 1, token_mult_prob_error 1).
The learning run's numbers are in docs/agents.md."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from nemo_rl.cli import main

from tiny_grpo import train_records

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]


def test_agent_recipe_trains_on_the_engines_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the recipe's data paths are relative to the checkout
    log_dir = tmp_path / "logs"
    with mock.patch.dict(os.environ):
        code = main(
            [
                "grpo", "--config", "configs/grpo_agent_calculator_tiny_cpu.yaml",
                "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_start=false",
                "checkpointing.enabled=false", "sft_warmup.num_steps=5",
                f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false",
            ]
        )
    assert code == 0
    records = train_records(log_dir)
    assert sorted(records) == [1, 2]
    for metrics in records.values():
        assert metrics["rollout/env_errors"] == 0
        assert metrics["rollout/agent_calls"] >= 1.0
        assert metrics["rollout/agent_unchained_calls"] == 0.0
        assert metrics["rollout/mean_generated_tokens_per_sample"] > 0
    first = records[1]
    assert abs(first["token_mult_prob_error"] - 1.0) < 1e-3
    assert abs(first["probs_ratio"] - 1.0) < 1e-6
