"""The built-in synthetic arithmetic task: seeded problems with exact ground truth.

Rows are plain dicts ``{"prompt": "What is 3 + 4?", "answer": "7"}`` (and ``"response"`` for the
SFT warm-start set), the same shape as rows read from a file, so they go through the same
processors. Evaluation order is Python's (``*`` before ``+``/``-``).
"""

from __future__ import annotations

import random

from nemo_rl.data.config import SyntheticArithmeticConfig

# Name under which the task is registered (DataConfig.dataset_name) and its environment task.
SYNTHETIC_ARITHMETIC = "synthetic_arithmetic"
SYNTHETIC_TASK_NAME = "math"


def format_answer(answer: str, answer_format: str) -> str:
    """The text of a correct response: ``\\boxed{answer}`` or the bare answer."""
    if answer_format == "boxed":
        return f"\\boxed{{{answer}}}"
    if answer_format == "plain":
        return answer
    raise ValueError(f'answer_format must be "boxed" or "plain", got {answer_format!r}')


def _problem(rng: random.Random, cfg: SyntheticArithmeticConfig) -> tuple[str, str]:
    """One expression and its value, e.g. ``("3 + 4", "7")``."""
    terms = [str(rng.randint(cfg.min_operand, cfg.max_operand)) for _ in range(cfg.num_terms)]
    expression = terms[0]
    for term in terms[1:]:
        expression += f" {rng.choice(cfg.operators)} {term}"
    # Only digits, spaces and + - * reach eval; the builtins are removed.
    value = eval(expression, {"__builtins__": {}}, {})  # noqa: S307
    return expression, str(value)


def generate_arithmetic_rows(
    num: int, cfg: SyntheticArithmeticConfig, seed: int, with_response: bool = False
) -> list[dict[str, str]]:
    """``num`` problems from a generator seeded with ``seed``; identical for identical args.

    Args:
        num: rows to generate.
        cfg: operand range, operators, number of terms and answer format.
        seed: generator seed.
        with_response: add ``"response"``, the correct answer in ``cfg.answer_format``
            (for supervised warm-start).

    Returns:
        Rows ``{"prompt": "What is 3 + 4?", "answer": "7"[, "response": "\\boxed{7}"]}``.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        expression, answer = _problem(rng, cfg)
        row = {"prompt": f"What is {expression}?", "answer": answer}
        if with_response:
            row["response"] = format_answer(answer, cfg.answer_format)
        rows.append(row)
    return rows


def synthetic_arithmetic_splits(
    cfg: SyntheticArithmeticConfig,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train rows, validation rows) of the task: ``cfg.num_train`` from ``cfg.seed`` and
    ``cfg.num_val`` from ``cfg.seed + 1``."""
    return (
        generate_arithmetic_rows(cfg.num_train, cfg, cfg.seed),
        generate_arithmetic_rows(cfg.num_val, cfg, cfg.seed + 1),
    )


def synthetic_arithmetic_sft_rows(cfg: SyntheticArithmeticConfig, num: int) -> list[dict[str, str]]:
    """``num`` warm-start rows with a correct ``"response"``, drawn like the training split."""
    return generate_arithmetic_rows(num, cfg, cfg.seed, with_response=True)


def default_prompt_template(answer_format: str) -> str:
    """Prompt template (``{}`` is the problem) asking for the answer in ``answer_format``."""
    if answer_format == "boxed":
        return "{} Give the answer as \\boxed{{N}}."
    return "{} Give only the number."


def synthetic_chat_rows(
    cfg: SyntheticArithmeticConfig, num: int, seed: int, chat_key: str = "messages"
) -> list[dict[str, list[dict[str, str]]]]:
    """``num`` conversations (SFT rows): a question and its correct answer as a user and an
    assistant message under ``chat_key``, drawn like :func:`generate_arithmetic_rows`."""
    return [
        {
            chat_key: [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["response"]},
            ]
        }
        for row in generate_arithmetic_rows(num, cfg, seed, with_response=True)
    ]


def synthetic_preference_rows(
    cfg: SyntheticArithmeticConfig, num: int, seed: int
) -> list[dict[str, str]]:
    """``num`` preference rows (DPO) ``{"prompt", "chosen", "rejected"}``: a question, its
    correct answer and a wrong one (the value off by 1 or 2 either way), both in
    ``cfg.answer_format``."""
    rng = random.Random(seed)
    rows = []
    for row in generate_arithmetic_rows(num, cfg, seed, with_response=True):
        wrong = int(row["answer"]) + rng.choice((-2, -1, 1, 2))
        rows.append(
            {
                "prompt": row["prompt"],
                "chosen": row["response"],
                "rejected": format_answer(str(wrong), cfg.answer_format),
            }
        )
    return rows
