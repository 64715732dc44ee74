"""Calculator tool environment: the safe evaluator and scripted tool-use episodes."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.environments.calculator_environment import (
    CalculatorEnvironment,
    CalculatorError,
    evaluate_expression,
    format_number,
)
from nemo_rl.environments.config import CalculatorEnvConfig


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -2", 0.25),
        ("-(3 - 5)", 2),
        ("1.5 * 4", 6.0),
    ],
)
def test_evaluates_arithmetic(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('ls')", "Call is not allowed"),
        ("open('/etc/passwd').read()", "Call is not allowed"),
        ("().__class__.__bases__", "Attribute is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "unsupported value"),
        ("[1, 2][0]", "Subscript is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("True + 1", "unsupported value"),
        ("2 ** 1000", "exponent 1000 exceeds 64"),
        ("(10 ** 60) ** 2", "more than 100 digits"),
        ("1e308 * 10", "not finite"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("import os", "cannot parse"),
        ("1" + " + 1" * 100, "longer than 200 characters"),
    ],
)
def test_refuses_what_is_not_plain_arithmetic(expression, reason):
    with pytest.raises(CalculatorError, match=reason.replace("(", r"\(").replace("*", r"\*")):
        evaluate_expression(expression)


def test_timeout_stops_the_walk():
    cfg = CalculatorEnvConfig(timeout_s=1e-9, max_expression_chars=10_000)
    with pytest.raises(CalculatorError, match="timed out"):
        evaluate_expression(" + ".join(["3 ** 20"] * 500), cfg)
    # the same expression within the default limit evaluates
    roomy = CalculatorEnvConfig(max_expression_chars=10_000)
    assert evaluate_expression(" + ".join(["3 ** 20"] * 500), roomy) == 500 * 3**20


def test_format_number():
    assert [format_number(v) for v in (3, 6.0, 0.5, 10 / 3)] == ["3", "6", "0.5", "3.33333333333"]


def message(role, content):
    return {"role": role, "content": content, "token_ids": torch.zeros(1, dtype=torch.long)}


def test_tool_call_then_correct_answer():
    env = CalculatorEnvironment(CalculatorEnvConfig(max_turns=3))
    log = [message("user", "What is 123 * 45 + 6?")]
    meta = {"ground_truth": "5541"}

    log.append(message("assistant", "Let me compute. <calc>123 * 45 + 6"))
    out = env.step([log], [meta])
    assert out.observations == [{"role": "tool", "content": "<result>5541</result>"}]
    assert out.rewards.tolist() == [0.0] and out.terminateds.tolist() == [False]
    assert out.next_stop_strings == [["</calc>", "</answer>"]]
    assert out.metadata == [{"ground_truth": "5541", "turn": 1}]

    log.append(message("tool", out.observations[0]["content"]))
    log.append(message("assistant", "<answer>5541</answer>"))
    out = env.step([log], out.metadata)
    assert out.rewards.tolist() == [1.0] and out.terminateds.tolist() == [True]
    assert out.answers == ["5541"] and out.metadata == [None]


def test_malicious_call_gets_an_error_result_and_wrong_answer_scores_zero():
    env = CalculatorEnvironment()
    logs = [
        [message("assistant", "<calc>__import__('os').system('touch /tmp/pwned')</calc>")],
        [message("assistant", "The answer is \\boxed{6}")],
    ]
    out = env.step(logs, [{"ground_truth": "7"}, {"ground_truth": "7"}])
    assert out.observations[0]["content"].startswith("<result>error: Call is not allowed")
    assert out.terminateds.tolist() == [False, True]
    assert out.rewards.tolist() == [0.0, 0.0]
    assert out.answers == [None, "6"]


def test_episode_ends_after_max_turns_of_calls():
    env = CalculatorEnvironment(CalculatorEnvConfig(max_turns=2))
    meta = {"ground_truth": "1"}
    log = [message("assistant", "<calc>1+1</calc>")]
    first = env.step([log], [meta])
    second = env.step([log], first.metadata)
    assert first.terminateds.tolist() == [False]
    assert second.terminateds.tolist() == [True] and second.rewards.tolist() == [0.0]
