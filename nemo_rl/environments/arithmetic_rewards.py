"""Two reward functions for the synthetic arithmetic task (rows ``{"prompt": "What is 3 + 4?",
"answer": "7"}``): the named rewards of the GDPO recipe ``configs/grpo_gdpo_tiny_cpu.yaml``
(``env.<task>.reward_fns``), each ``fn(prompt, response, answer, metadata) -> float``.

``correctness`` looks at the number the reply gives, ``boxed_format`` at its form only, so a
reply can earn either one alone: ``"7"`` scores (1, 0) and ``"\\boxed{8}"`` (0, 1) on
"What is 3 + 4?", the same total that GRPO cannot tell apart and GDPO can.
"""

from __future__ import annotations

import re
from typing import Any, Optional

_BOXED_INTEGER = re.compile(r"\s*\\boxed\{\s*(-?\d+)\s*\}\s*")
_INTEGER = re.compile(r"-?\d+")


def correctness(prompt: Any, response: str, answer: Optional[str], metadata: dict) -> float:
    """1.0 when the last integer of ``response`` (boxed or not) equals ``answer``, else 0.0."""
    numbers = _INTEGER.findall(response)
    return float(answer is not None and bool(numbers) and int(numbers[-1]) == int(answer))


def boxed_format(prompt: Any, response: str, answer: Optional[str], metadata: dict) -> float:
    """1.0 when ``response`` is exactly one ``\\boxed{<integer>}`` (surrounding blanks
    allowed), whatever the integer; else 0.0."""
    return float(_BOXED_INTEGER.fullmatch(response) is not None)
