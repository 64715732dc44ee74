"""pass@k against the closed form and against counting every k-subset, maj@k by hand (and only
for tasks that return answers), the eval config's checks, the warning about prompts that leave
too little room to generate, and the per-sample records of a rollout (with token ids and
logprobs)."""

from __future__ import annotations

import itertools
import logging
from math import comb
from pathlib import Path

import pytest
import torch

from nemo_rl.evals.config import EvalMasterConfig
from nemo_rl.evals.eval import check_generation_room, format_summary, sample_records, score_records
from nemo_rl.evals.metrics import majority_passes, pass_at_k, summarize
from nemo_rl.utils.config import ConfigError


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
    without = summarize(passed, None, rewards, k=2)  # environments that return no answers
    assert "maj@2" not in without and without == {k: v for k, v in scores.items() if k != "maj@2"}


def reply(text: str, ids: list[int], logprobs: list[float]) -> dict:
    return {"role": "assistant", "content": text, "token_ids": torch.tensor(ids),
            "generation_logprobs": torch.tensor(logprobs)}


def test_records_of_a_rollout_and_their_scores():
    prompt = [{"role": "system", "content": "Be brief. ", "token_ids": torch.tensor([4, 5])},
              {"role": "user", "content": "What is 1 + 1?", "token_ids": torch.tensor([1])}]
    prompts = {
        "message_log": [prompt, prompt],
        "extra_env_info": [{"ground_truth": "2"}, {"ground_truth": "3"}],
        "task_name": ["math", "math"],
        "idx": [10, 11],
    }
    replies = [reply(f"\\boxed{{{n}}}", [20 + n, 9], [-0.5, -0.25]) for n in (2, 5, 3, 3)]
    observation = {"role": "environment", "content": "again", "token_ids": torch.tensor([7])}
    rollout = {
        "message_log": [prompt + [r] for r in replies[:3]]
        + [prompt + [replies[3], observation, reply("3", [23], [-1.0])]],
        "total_reward": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "answers": ["2", "5", "3", "3"],
        "response_truncated": torch.tensor([False, True, False, False]),
    }
    records = sample_records(prompts, rollout, num_tests=2, threshold=1.0)
    assert [(r["prompt_index"], r["sample"]) for r in records] == [(10, 0), (10, 1), (11, 0), (11, 1)]
    assert records[1] == {
        "prompt_index": 10, "sample": 1, "task_name": "math",
        "prompt": "Be brief. What is 1 + 1?", "prompt_token_ids": [4, 5, 1],
        "response": "\\boxed{5}", "response_token_ids": [25, 9], "response_logprobs": [-0.5, -0.25],
        "later_turns": [], "answer": "5", "ground_truth": "2",
        "reward": 0.0, "passed": False, "truncated": True,
    }
    assert records[3]["later_turns"] == [
        {"role": "environment", "content": "again", "token_ids": [7]},
        {"role": "assistant", "content": "3", "token_ids": [23], "logprobs": [-1.0]},
    ]
    scores = score_records(records, k=2)
    assert scores["accuracy"] == 0.75 and scores["pass@2"] == 1.0 and scores["pass@1"] == 0.75
    assert scores["num_truncated"] == 1 and scores["maj@2"] == 1.0  # 2-vs-5 tie goes to 2
    assert "maj@2" not in score_records(records, k=2, vote=False)


def test_config_checks_name_the_fields():
    with pytest.raises(ValueError, match="eval.k_value \\(4\\) exceeds eval.num_tests_per_prompt"):
        EvalMasterConfig.model_validate({"eval": {"k_value": 4, "num_tests_per_prompt": 2}})
    with pytest.raises(ValueError, match="generation.vllm_cfg.max_model_len is unset"):
        EvalMasterConfig.model_validate({})
    cfg = EvalMasterConfig.model_validate({"generation": {"vllm_cfg": {"max_model_len": 64}}})
    assert cfg.data.max_input_seq_length == 64


REWARD_MODULE = """
def score(prompt, response, answer, metadata):
    return float(answer in response)


def digits(prompt, response, answer, metadata):
    return "".join(ch for ch in response if ch.isdigit()) or None
"""


def test_maj_at_k_needs_a_task_that_returns_answers(tmp_path: Path, monkeypatch) -> None:
    """A reward function's task returns no answers unless its section has an answer_fn:
    maj@k is refused for it at config time (pass@k leaves maj@k out of the summary)."""
    (tmp_path / "eval_reward_q.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = {"generation": {"vllm_cfg": {"max_model_len": 64}}, "data": {"task_name": "digits"},
            "env": {"math": None, "digits": {"reward_fn": "eval_reward_q:score"}}}
    for metric in ("maj@k", "cons@k"):
        with pytest.raises(ValueError) as info:
            EvalMasterConfig.model_validate({**base, "eval": {"metric": metric}})
        assert (f"eval.metric={metric} votes over the answers a task's environment extracts, "
                "but task 'digits' (env.digits) returns none: give its reward_fn an answer_fn"
                ) in str(info.value)
    cfg = EvalMasterConfig.model_validate({**base, "eval": {"metric": "pass@k", "k_value": 2,
                                                            "num_tests_per_prompt": 2}})
    table = format_summary({"accuracy": 0.5, "pass@2": 1.0, "num_prompts": 1.0}, cfg)
    assert table.endswith("\n  maj@2        not scored: a task's environment returns no answers "
                          "to vote over (a reward_fn task: set its answer_fn)")
    voting = {**base, "eval": {"metric": "maj@k"},
              "env": {"math": None, "digits": {"reward_fn": "eval_reward_q:score",
                                               "answer_fn": "eval_reward_q:digits"}}}
    assert EvalMasterConfig.model_validate(voting).env.specs()["digits"].returns_answers
    math = EvalMasterConfig.model_validate({**base, "eval": {"metric": "maj@k"},
                                            "data": {"task_name": None}, "env": {}})
    assert math.eval.votes


def test_prompts_without_room_for_max_new_tokens_warn_once(caplog) -> None:
    batches = [{"length": torch.tensor([40, 54])}, {"length": torch.tensor([58, 30])}]
    with caplog.at_level(logging.WARNING, logger="nemo_rl.evals.eval"):
        check_generation_room(batches, max_new_tokens=16, max_model_len=64)
    (record,) = caplog.records
    assert record.getMessage() == (
        "2 of 4 prompts leave fewer than generation.max_new_tokens=16 tokens under "
        "generation.vllm_cfg.max_model_len=64 (the longest has 58 tokens: its responses stop "
        "after 6); such responses are cut there and counted in num_truncated. Raise "
        "max_model_len to 74 to give every response its max_new_tokens"
    )
    caplog.clear()
    check_generation_room(batches, max_new_tokens=6, max_model_len=64)
    assert caplog.records == []
    with pytest.raises(ConfigError, match="a prompt has 64 tokens, not below generation.vllm_cfg."
                                          "max_model_len=64"):
        check_generation_room([{"length": torch.tensor([64])}], 16, 64)


def test_launch_sizes_an_eval_job_from_its_recipe():
    from pathlib import Path

    from nemo_rl.launch.recipe import recipe_shape

    recipe = Path(__file__).resolve().parents[3] / "configs" / "eval_tiny_cpu.yaml"
    shape = recipe_shape(["nemo-rl", "eval", "--config", str(recipe), "cluster.num_nodes=2"])
    assert (shape.nodes, shape.gpus_per_node) == (2, 0)
