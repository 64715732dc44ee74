"""MathEnvironment: math-verify equivalences, batch stepping, metrics."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.environments.config import MathEnvConfig
from nemo_rl.environments.math_environment import MathEnvironment, verify_answer


def conversation(answer: str) -> list[dict]:
    ids = torch.zeros(1, dtype=torch.long)
    return [
        {"role": "user", "content": "What is it?", "token_ids": ids},
        {"role": "assistant", "content": answer, "token_ids": ids},
    ]


@pytest.mark.parametrize(
    ("response", "truth", "correct"),
    [
        ("The answer is \\boxed{42}.", "42", True),
        ("So we get \\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("half of it: 1/2", "0.5", True),
        ("2 + 3 = 5, so the total is 5", "5", True),
        ("<answer>12</answer>", "12", True),
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", True),
        ("\\boxed{1 + x}", "x+1", True),
        ("The answer is \\boxed{41}.", "42", False),
        ("It is 0.3", "\\frac{1}{3}", False),
        ("I do not know.", "7", False),
    ],
)
def test_verify_answer(response, truth, correct):
    assert verify_answer(response, truth)[0] is correct


def test_extracted_answer():
    assert verify_answer("first 3 then \\boxed{17}", "17") == (True, "17")
    assert verify_answer("no numbers here", "17") == (False, None)


def test_unparsable_ground_truth_names_the_field():
    with pytest.raises(ValueError, match="ground_truth"):
        verify_answer("\\boxed{1}", "")


def test_step_scores_and_terminates_every_sample():
    env = MathEnvironment(MathEnvConfig(stop_strings=["</s>"]))
    out = env.step(
        [conversation("\\boxed{4}"), conversation("\\boxed{5}"), conversation("1/4")],
        [{"ground_truth": "4"}, {"ground_truth": "4"}, {"ground_truth": "0.25"}],
    )
    assert out.rewards.dtype == torch.float32
    assert out.rewards.tolist() == [1.0, 0.0, 1.0]
    assert out.terminateds.tolist() == [True, True, True]
    assert out.answers[:2] == ["4", "5"]
    assert out.next_stop_strings == [["</s>"]] * 3
    assert [o["content"] for o in out.observations] == ["correct", "incorrect", "correct"]


def test_missing_ground_truth_names_the_sample():
    with pytest.raises(KeyError, match="sample 1.*ground_truth"):
        MathEnvironment().step(
            [conversation("1"), conversation("2")], [{"ground_truth": "1"}, {"answer": "2"}]
        )


def test_worker_processes_give_the_same_results():
    responses = [f"\\boxed{{{n}}}" for n in range(6)]
    truths = [{"ground_truth": str(n if n % 2 else n + 1)} for n in range(6)]
    logs = [conversation(r) for r in responses]
    env = MathEnvironment(MathEnvConfig(num_workers=2))
    try:
        parallel = env.step(logs, truths)
    finally:
        env.shutdown()
    serial = MathEnvironment().step(logs, truths)
    assert parallel.rewards.tolist() == serial.rewards.tolist() == [0, 1, 0, 1, 0, 1]
    assert parallel.answers == serial.answers


def test_metrics_accuracy_and_pass_at_k():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    batch = {"total_reward": rewards, "idx": [0, 0, 1, 1, 2, 2]}
    _, metrics = MathEnvironment().global_post_process_and_metrics(batch)
    assert metrics == {"accuracy": 0.5, "pass@2": pytest.approx(2 / 3)}
    _, metrics = MathEnvironment().global_post_process_and_metrics(
        {"total_reward": torch.tensor([1.0, 0.0])}
    )
    assert metrics == {"accuracy": 0.5}


def test_a_repeated_judgement_is_answered_from_memory():
    verify_answer.cache_clear()
    first = verify_answer("so \\boxed{12}", "12")
    assert verify_answer("so \\boxed{12}", "12") == first == (True, "12")
    assert verify_answer.cache_info().hits == 1


def test_responses_reaching_one_answer_are_compared_once(monkeypatch):
    from nemo_rl.environments import math_environment

    compared = []
    real_verify = math_environment.verify

    def counting_verify(*args, **kwargs):
        compared.append(args)
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(math_environment, "verify", counting_verify)
    monkeypatch.setattr(math_environment, "_EQUIVALENT", {})
    verify_answer.cache_clear()
    assert verify_answer("it is \\boxed{12}", "12") == (True, "12")
    assert verify_answer("so, 5 + 7 = \\boxed{12}.", "12") == (True, "12")
    assert verify_answer("\\boxed{12.0}", "12")[0]  # a float parse: compared on its own
    assert not verify_answer("\\boxed{13}", "12")[0]
    assert len(compared) == 3
