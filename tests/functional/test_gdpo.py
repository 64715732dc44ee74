"""GDPO end to end: the GDPO recipe's estimator, task and two reward functions
(configs/grpo_gdpo_tiny_cpu.yaml) on the tiny colocated run's shape, on the held
``tiny_colocated_stack`` (tests/grpo_stack.py: no workers or engines of its own; its run length
``WARM_RUN_STEPS``, which sets the learning-rate horizon the stack's shape includes). The reward
functions run in their environment's Ray actor, their named rewards travel through the rollout
to the step's GDPO advantages, and each is logged per step; ``reward`` is their sum. The
advantages themselves are checked against hand computations in
tests/unit/algorithms/test_advantage_estimators.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from nemo_rl.utils.logger import read_metrics_jsonl

from grpo_stack import run_grpo_on
from tiny_grpo import WARM_RUN_STEPS, tiny_grpo_config

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "grpo_gdpo_tiny_cpu.yaml"


def test_gdpo_recipe_trains_and_logs_each_reward(
    tmp_path: Path, tiny_llama_path: Path, tiny_colocated_stack
) -> None:
    recipe = yaml.safe_load(RECIPE.read_text())
    cfg = tiny_grpo_config(
        tmp_path / "logs", tiny_llama_path,
        grpo={"max_num_steps": WARM_RUN_STEPS, "adv_estimator": recipe["grpo"]["adv_estimator"]},
        data=recipe["data"], env=recipe["env"],
    )
    assert cfg.grpo.adv_estimator.name == "gdpo"
    run_grpo_on(tiny_colocated_stack, cfg)
    records = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    train = {r["step"]: r["metrics"] for r in records if r["prefix"] == "train"}
    assert sorted(train) == list(range(1, WARM_RUN_STEPS + 1))
    for metrics in train.values():
        assert metrics["reward"] == pytest.approx(
            metrics["reward/correctness"] + metrics["reward/format"], abs=1e-6
        )
        assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "reward/format"))
    # every logged metric is in the glossary (the named rewards as `reward/<name>`)
    glossary = (RECIPE.parents[1] / "docs" / "metrics.md").read_text()
    logged = {key for r in records for key in r["metrics"]}
    named = {key for key in logged if key.startswith("reward/")}
    assert named == {"reward/correctness", "reward/format"} and "`reward/<name>`" in glossary
    assert not {key for key in logged - named if f"`{key}`" not in glossary}
