"""pass@k against the closed form and against counting every k-subset, maj@k by hand, the eval
config's checks, and the per-sample records of a rollout."""

from __future__ import annotations

import itertools
from math import comb

import pytest
import torch

from nemo_rl.evals.config import EvalMasterConfig
from nemo_rl.evals.eval import sample_records, score_records
from nemo_rl.evals.metrics import majority_passes, pass_at_k, summarize


def subsets_with_a_pass(passed: list[bool], k: int) -> float:
    """Share of the k-subsets of the samples that hold a passing one (the definition)."""
    subsets = list(itertools.combinations(passed, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_hand_made_case():
    # 5 samples, 2 pass: 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # only 2 failures: every 3-subset holds a pass


@pytest.mark.parametrize("n", [1, 4, 7])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n):
    for c in range(n + 1):
        passed = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            expected = 1 - comb(n - c, k) / comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(subsets_with_a_pass(passed, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_majority_vote():
    assert majority_passes(["7", "8", "7", None], [True, False, True, False])
    assert not majority_passes(["8", "8", "7"], [False, False, True])
    # a tie goes to the answer given first
    assert majority_passes(["7", "8", "8", "7"], [True, False, False, True])
    assert not majority_passes([None, None], [False, False])


def test_summarize_hand_made():
    passed = [[True, False, False, True], [False, False, False, False]]
    answers = [["7", "6", "6", "7"], ["1", None, "2", "2"]]
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.5]]
    scores = summarize(passed, answers, rewards, k=2)
    assert scores["accuracy"] == 2 / 8
    assert scores["reward"] == 2.5 / 8
    assert scores["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert scores["pass@2"] == pytest.approx((1 - comb(2, 2) / comb(4, 2)) / 2)
    # first two samples: prompt 0 votes 7 vs 6 (tie -> 7, passed); prompt 1 only "1" (failed)
    assert scores["maj@2"] == 0.5
    assert scores["num_prompts"] == 2 and scores["num_samples"] == 8


def test_records_of_a_rollout_and_their_scores():
    prompt = [{"role": "user", "content": "What is 1 + 1?", "token_ids": torch.tensor([1])}]
    prompts = {
        "message_log": [prompt, prompt],
        "extra_env_info": [{"ground_truth": "2"}, {"ground_truth": "3"}],
        "task_name": ["math", "math"],
        "idx": [10, 11],
    }
    replies = ["\\boxed{2}", "\\boxed{5}", "\\boxed{3}", "\\boxed{3}"]
    rollout = {
        "message_log": [prompt + [{"role": "assistant", "content": r}] for r in replies],
        "total_reward": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "answers": ["2", "5", "3", "3"],
    }
    records = sample_records(prompts, rollout, num_tests=2, threshold=1.0)
    assert [(r["prompt_index"], r["sample"]) for r in records] == [(10, 0), (10, 1), (11, 0), (11, 1)]
    assert records[1] == {
        "prompt_index": 10, "sample": 1, "task_name": "math", "prompt": "What is 1 + 1?",
        "response": "\\boxed{5}", "later_turns": [], "answer": "5", "ground_truth": "2",
        "reward": 0.0, "passed": False,
    }
    scores = score_records(records, k=2)
    assert scores["accuracy"] == 0.75 and scores["pass@2"] == 1.0 and scores["pass@1"] == 0.75


def test_config_checks_name_the_fields():
    with pytest.raises(ValueError, match="eval.k_value \\(4\\) exceeds eval.num_tests_per_prompt"):
        EvalMasterConfig.model_validate({"eval": {"k_value": 4, "num_tests_per_prompt": 2}})
    with pytest.raises(ValueError, match="generation.vllm_cfg.max_model_len is unset"):
        EvalMasterConfig.model_validate({})
    cfg = EvalMasterConfig.model_validate({"generation": {"vllm_cfg": {"max_model_len": 64}}})
    assert cfg.data.max_input_seq_length == 64


def test_launch_sizes_an_eval_job_from_its_recipe():
    from pathlib import Path

    from nemo_rl.launch.recipe import recipe_shape

    recipe = Path(__file__).resolve().parents[3] / "configs" / "eval_tiny_cpu.yaml"
    shape = recipe_shape(["nemo-rl", "eval", "--config", str(recipe), "cluster.num_nodes=2"])
    assert (shape.nodes, shape.gpus_per_node) == (2, 0)
