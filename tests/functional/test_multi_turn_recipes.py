"""The shipped multi-turn recipes run from the CLI on their own data: number guessing (several
guesses per sample) and the calculator tool (after a short warm start on the recipe's own
demonstrations file), two GRPO steps each, every environment call answered without an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiny_grpo import train_records

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "recipe, min_turns",
    [("grpo_number_guess_tiny_cpu.yaml", 1.5), ("grpo_calculator_tiny_cpu.yaml", 1.0)],
)
def test_multi_turn_recipe_runs_from_the_cli(recipe: str, min_turns: float, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    run = subprocess.run(
        [
            sys.executable, "-m", "nemo_rl.cli", "grpo", "--config", f"configs/{recipe}",
            "grpo.max_num_steps=2", "grpo.val_period=2", "grpo.val_at_start=false",
            "grpo.max_val_samples=8", "checkpointing.enabled=false", "sft_warmup.num_steps=5",
            f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=840,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = train_records(log_dir)
    assert sorted(records) == [1, 2]
    for metrics in records.values():
        assert metrics["rollout/env_errors"] == 0
        assert metrics["rollout/mean_turns_per_sample"] >= min_turns, metrics
