"""The built-in arithmetic task: seeded, correct, knobs honoured, answers the checker accepts."""

from __future__ import annotations

import re

import pytest
from math_verify import parse, verify

from nemo_rl.data.config import SyntheticArithmeticConfig
from nemo_rl.data.synthetic import (
    default_prompt_template,
    format_answer,
    generate_arithmetic_rows,
    synthetic_arithmetic_sft_rows,
    synthetic_arithmetic_splits,
)

_PROBLEM = re.compile(r"^What is (.+)\?$")


def _terms(prompt: str) -> list[str]:
    match = _PROBLEM.match(prompt)
    assert match, prompt
    return match.group(1).split(" ")


def test_default_is_single_digit_addition_with_correct_answers() -> None:
    rows = generate_arithmetic_rows(200, SyntheticArithmeticConfig(), seed=3)
    for row in rows:
        a, op, b = _terms(row["prompt"])
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert row["answer"] == str(int(a) + int(b))


def test_same_seed_same_rows_other_seed_other_rows() -> None:
    cfg = SyntheticArithmeticConfig()
    assert generate_arithmetic_rows(50, cfg, 7) == generate_arithmetic_rows(50, cfg, 7)
    assert generate_arithmetic_rows(50, cfg, 7) != generate_arithmetic_rows(50, cfg, 8)


def test_difficulty_knobs() -> None:
    cfg = SyntheticArithmeticConfig(
        min_operand=10, max_operand=20, operators=["-", "*"], num_terms=3
    )
    rows = generate_arithmetic_rows(300, cfg, seed=0)
    seen_ops = set()
    for row in rows:
        terms = _terms(row["prompt"])
        numbers, ops = [int(t) for t in terms[::2]], terms[1::2]
        assert len(numbers) == 3 and all(10 <= n <= 20 for n in numbers)
        seen_ops.update(ops)
        # Independent evaluation: products first, then left-to-right subtraction.
        values, signs = [numbers[0]], []
        for op, n in zip(ops, numbers[1:]):
            if op == "*":
                values[-1] *= n
            else:
                values.append(n)
                signs.append(-1)
        expected = values[0] + sum(s * v for s, v in zip(signs, values[1:]))
        assert row["answer"] == str(expected)
    assert seen_ops == {"-", "*"}


def test_bad_operand_range_names_fields() -> None:
    with pytest.raises(ValueError, match="data.synthetic.min_operand"):
        SyntheticArithmeticConfig(min_operand=5, max_operand=2)


def test_splits_and_sft_rows() -> None:
    cfg = SyntheticArithmeticConfig(num_train=40, num_val=12)
    train, val = synthetic_arithmetic_splits(cfg)
    assert len(train) == 40 and len(val) == 12 and train != val[:12]
    sft = synthetic_arithmetic_sft_rows(cfg, 10)
    assert [(r["prompt"], r["answer"]) for r in sft] == [
        (r["prompt"], r["answer"]) for r in train[:10]
    ]
    assert all(r["response"] == f"\\boxed{{{r['answer']}}}" for r in sft)


@pytest.mark.parametrize("answer_format", ["boxed", "plain"])
def test_math_verify_accepts_the_answer_format(answer_format: str) -> None:
    response = format_answer("12", answer_format)
    assert verify(parse("12"), parse(response))
    assert not verify(parse("13"), parse(response))
    assert "{}" in default_prompt_template(answer_format)


def test_unknown_answer_format() -> None:
    with pytest.raises(ValueError, match="answer_format"):
        format_answer("1", "latex")
