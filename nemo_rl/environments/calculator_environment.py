"""A tool environment: the model may call a calculator, ``<calc>expr</calc>``, before answering.

The expression is evaluated by walking its syntax tree with a whitelist (numbers, unary and
binary ``+ - * / // % **``, parentheses): no names, calls, attributes or subscripts, so no file,
network or interpreter access; raw text is never passed to ``eval``/``exec``. Exponents, integer
sizes and expression length are bounded and the walk stops past a deadline, so every call ends.
The result comes back as a ``tool`` message ``<result>...</result>``.

A turn with ``<answer>...</answer>``, or without a ``<calc>`` call, is the final answer: judged
against ``metadata["ground_truth"]`` with math-verify (reward 1.0 or 0.0) and the episode ends.
The episode also ends, unsolved, after ``max_turns`` turns.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from typing import Any, Callable, Optional, Union

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.common import (
    batch_success_metrics,
    last_assistant_content,
    tagged_text,
)
from nemo_rl.environments.config import CalculatorEnvConfig
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.environments.math_environment import verify_answer

CALC_STOP_STRINGS = ["</calc>", "</answer>"]

Number = Union[int, float]

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


class _Evaluator:
    """Evaluates a parsed expression within the limits of a :class:`CalculatorEnvConfig`."""

    def __init__(self, cfg: CalculatorEnvConfig, deadline: float) -> None:
        self.cfg = cfg
        self.deadline = deadline
        self.max_abs_int = 10 ** cfg.max_result_digits

    def check(self, value: Number) -> Number:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"unsupported value {value!r}")
        if isinstance(value, int) and abs(value) >= self.max_abs_int:
            raise CalculatorError(f"result has more than {self.cfg.max_result_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not finite")
        return value

    def eval(self, node: ast.AST) -> Number:
        if time.monotonic() > self.deadline:
            raise CalculatorError(f"timed out after {self.cfg.timeout_s:g} s")
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant):
            return self.check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.check(_UNARY[type(node.op)](self.eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.cfg.max_exponent:
                raise CalculatorError(f"exponent {right} exceeds {self.cfg.max_exponent}")
            try:
                result = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result overflows") from None
            if isinstance(result, complex):
                raise CalculatorError("result is not a real number")
            return self.check(result)
        raise CalculatorError(
            f"{type(node).__name__} is not allowed; use numbers and + - * / // % **"
        )


def evaluate_expression(expression: str, cfg: Optional[CalculatorEnvConfig] = None) -> Number:
    """Evaluate an arithmetic expression safely.

    Args:
        expression: e.g. ``"(3 + 4) * 2 ** 3"``.
        cfg: limits (length, exponent, digits, timeout); defaults when None.

    Returns:
        The value: an int, or a float when division or a float operand is involved.

    Raises:
        CalculatorError: the expression is too long, malformed, uses anything outside the
            whitelist, breaks a limit, divides by zero or runs past ``cfg.timeout_s``.
    """
    cfg = cfg or CalculatorEnvConfig()
    deadline = time.monotonic() + cfg.timeout_s
    if len(expression) > cfg.max_expression_chars:
        raise CalculatorError(f"expression longer than {cfg.max_expression_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CalculatorError(f"cannot parse the expression ({type(err).__name__})") from None
    try:
        return _Evaluator(cfg, deadline).eval(tree)
    except RecursionError:
        raise CalculatorError("expression nests too deeply") from None


def format_number(value: Number) -> str:
    """Integers as is, floats with up to 12 significant digits (``0.5``, ``3.33333333333``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class CalculatorEnvironment(EnvironmentInterface):
    """Calculator tool plus final-answer judge; usable in-process or as a Ray actor.

    Metadata per sample: ``{"ground_truth": str}``; the environment adds ``"turn"``.
    """

    default_processor = "math"
    required_fields = ("answer",)
    returns_answers = True

    def __init__(self, cfg: Optional[CalculatorEnvConfig] = None) -> None:
        self.cfg = cfg or CalculatorEnvConfig()

    def _calc(self, expression: str) -> str:
        try:
            return f"<result>{format_number(evaluate_expression(expression, self.cfg))}</result>"
        except CalculatorError as err:
            return f"<result>error: {err}</result>"

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Run each sample's calculator call, or judge its final answer.

        Raises:
            KeyError: a sample's metadata has no ``ground_truth``.
        """
        observations, new_metadata, rewards, terminateds, answers = [], [], [], [], []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            if "ground_truth" not in (meta or {}):
                raise KeyError(
                    f"sample {i}: metadata has no 'ground_truth' (keys: {sorted(meta or {})}); "
                    "the calculator task's data processor must set extra_env_info['ground_truth']"
                )
            state = dict(meta)
            state["turn"] = int(state.get("turn", 0)) + 1
            text = last_assistant_content(log)
            expression = tagged_text(text, "calc")
            if expression is not None and tagged_text(text, "answer") is None:
                done = state["turn"] >= self.cfg.max_turns
                observations.append({"role": "tool", "content": self._calc(expression)})
                new_metadata.append(None if done else state)
                rewards.append(0.0)
                terminateds.append(done)
                answers.append(None)
                continue
            correct, answer = verify_answer(
                text, str(state["ground_truth"]), self.cfg.verify_timeout_s
            )
            verdict = "correct" if correct else "incorrect"
            observations.append({"role": "environment", "content": verdict})
            new_metadata.append(None)
            rewards.append(1.0 if correct else 0.0)
            terminateds.append(True)
            answers.append(answer)
        size = len(observations)
        return EnvironmentReturn(
            observations=observations,
            metadata=new_metadata,
            next_stop_strings=[list(CALC_STOP_STRINGS)] * size,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminateds, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """``accuracy`` (reward 1) and ``pass@k`` over ``batch["idx"]`` groups; batch unchanged."""
        return batch, batch_success_metrics(batch)
