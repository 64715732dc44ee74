"""DPO end to end on CPU (``nemo-rl dpo``'s run on configs/dpo_tiny_cpu.yaml): real Ray and a
Megatron worker with its frozen reference, the synthetic task's preference pairs (correct vs
off-by-one-or-two answers). One run, several checks: before any update the policy is its
reference (implicit rewards exactly 0); training raises the preference accuracy on the
validation pairs (drawn with another seed; the 25 questions of operands 0-4 recur) well above
chance, with the chosen replies' implicit reward above the rejected ones'."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.algorithms import dpo
from nemo_rl.algorithms.dpo_config import DPOMasterConfig
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def validation(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, float]]:
    """Validation metrics by step of the tiny recipe as shipped (without checkpoints)."""
    tmp = tmp_path_factory.mktemp("dpo")
    cfg = load_typed_config(
        REPO / "configs" / "dpo_tiny_cpu.yaml",
        [f"logger.log_dir={tmp / 'logs'}", "logger.console_enabled=false", "checkpointing.enabled=false"],
        DPOMasterConfig,
    )
    assert dpo.run(cfg) is None
    records = read_metrics_jsonl(tmp / "logs" / "metrics.jsonl")
    return {r["step"]: r["metrics"] for r in records if r["prefix"] == "validation"}


def test_policy_starts_as_its_reference(validation: dict[int, dict[str, float]]) -> None:
    start = validation[0]
    assert start["rewards_chosen_mean"] == 0.0 and start["rewards_rejected_mean"] == 0.0
    assert start["accuracy"] == 0.0  # ties are not wins
    assert abs(start["loss"] - 0.6931472) < 1e-5  # -log sigmoid(0)


def test_held_out_preference_accuracy_rises(validation: dict[int, dict[str, float]]) -> None:
    end = validation[max(validation)]
    # 128 held-out pairs: the standard error of an accuracy is at most 0.044
    assert sorted(validation) == [0, 20, 40, 60]
    assert end["accuracy"] >= 0.75, validation
    assert end["rewards_chosen_mean"] > end["rewards_rejected_mean"], end
    assert end["loss"] < validation[0]["loss"] - 0.1, validation
