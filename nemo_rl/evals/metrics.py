"""Scores of k samples per prompt: unbiased pass@k and majority-vote maj@k (cons@k).

pass@k is the chance that at least one of k samples drawn without replacement from a
prompt's n samples passes, computed in closed form from the n samples' pass count c
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
``1 - C(n - c, k) / C(n, k)``, averaged over prompts. maj@k takes the answer most of a
prompt's first k samples gave (as the environment extracted it; samples without an answer do
not vote, ties go to the answer given first) and scores the prompt by whether a sample giving
that answer passed. It needs environments that return the answers they extract (a reward
function's task: its ``answer_fn``); without them it is not scored (``nemo-rl eval`` refuses
``eval.metric: maj@k`` for such a task).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb
from typing import Optional


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` passing samples out of ``n``.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_passes(answers: Sequence[Optional[str]], passed: Sequence[bool]) -> bool:
    """Whether the majority answer of a prompt's samples passed (see the module docstring);
    False when no sample gave an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return any(p for a, p in zip(answers, passed) if a == winner)


def summarize(
    passed: Sequence[Sequence[bool]],
    answers: Optional[Sequence[Sequence[Optional[str]]]],
    rewards: Sequence[Sequence[float]],
    k: int,
) -> dict[str, float]:
    """The scores of P prompts, each with its n samples' pass flags, answers (None: the
    environments return none) and rewards.

    Returns:
        ``accuracy`` (mean pass flag over all samples: pass@1 estimated from n samples),
        ``reward`` (mean reward), ``pass@1``, ``pass@{k}``, ``maj@{k}`` (over each prompt's
        first k samples; left out without answers), ``num_prompts``, ``num_samples``.
    """
    if not passed:
        raise ValueError("no prompts to score")
    num_prompts = len(passed)
    flat = [p for row in passed for p in row]
    scores = {
        "accuracy": sum(flat) / len(flat),
        "reward": sum(r for row in rewards for r in row) / len(flat),
        "pass@1": sum(pass_at_k(len(row), sum(row), 1) for row in passed) / num_prompts,
        f"pass@{k}": sum(pass_at_k(len(row), sum(row), k) for row in passed) / num_prompts,
    }
    if answers is not None:
        scores[f"maj@{k}"] = sum(
            majority_passes(list(a[:k]), list(p[:k])) for a, p in zip(answers, passed)
        ) / num_prompts
    scores["num_prompts"] = float(num_prompts)
    scores["num_samples"] = float(len(flat))
    return scores
