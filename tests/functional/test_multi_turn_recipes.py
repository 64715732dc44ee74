"""The shipped multi-turn recipes run from the CLI on their own data: number guessing (several
guesses per sample), the calculator tool and the calculator agent (an agent plug-in driving
the engine over its HTTP endpoint on 127.0.0.1; both after a short warm start on the recipe's
own demonstrations file), two GRPO steps each, every environment call answered without an
error, the first step on-policy (ratio 1, token_mult_prob_error 1: for the agent, the trained
tokens and logprobs are the ones the engine generated).
The command runs in the test's process (``nemo_rl.cli.main``, in the held local Ray); the
process-level CLI (its own Ray, exit codes, signals) is tested in test_checkpoint_survival.py."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from nemo_rl.cli import main

from tiny_grpo import train_records

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]
FOUR_PROMPTS = ["grpo.num_prompts_per_step=4", "policy.train_global_batch_size=32"]


@pytest.mark.parametrize(
    "recipe, min_turns, overrides",
    [
        # CI time: 4 prompts per step (32 samples) instead of the recipes' 8 or 16, one
        # optimizer step per GRPO step as in the recipes
        ("grpo_number_guess_tiny_cpu.yaml", 1.5, FOUR_PROMPTS),
        ("grpo_calculator_tiny_cpu.yaml", 1.0, FOUR_PROMPTS),
        ("grpo_agent_calculator_tiny_cpu.yaml", 1.0, FOUR_PROMPTS),
    ],
)
def test_multi_turn_recipe_runs_from_the_cli(
    recipe: str, min_turns: float, overrides: list[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `nemo-rl grpo` in this process (the held local Ray serves it); the recipes' relative paths
    # resolve from the checkout, as from the command line there
    monkeypatch.chdir(REPO)
    log_dir = tmp_path / "logs"
    with mock.patch.dict(os.environ):  # whatever the command exports stays in it
        code = main(
            [
                "grpo", "--config", f"configs/{recipe}",
                "grpo.max_num_steps=2", "grpo.val_period=2", "grpo.val_at_start=false",
                "grpo.max_val_samples=8", "checkpointing.enabled=false", "sft_warmup.num_steps=5",
                f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false", *overrides,
            ]
        )
    assert code == 0
    records = train_records(log_dir)
    assert sorted(records) == [1, 2]
    for metrics in records.values():
        assert metrics["rollout/env_errors"] == 0
        assert metrics["rollout/mean_turns_per_sample"] >= min_turns, metrics
        assert metrics.get("rollout/agent_unchained_calls", 0.0) == 0.0
    assert abs(records[1]["token_mult_prob_error"] - 1.0) < 1e-3
    assert abs(records[1]["probs_ratio"] - 1.0) < 1e-6
