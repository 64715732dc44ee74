"""Single-turn math: the last assistant message is checked against a ground truth with math-verify.

Equivalent forms count as equal (``\\boxed{\\frac{1}{2}}``, ``0.5``, ``1/2``); the answer is the
boxed expression when there is one, else the last number or expression of the response, or the
inside of an ``<answer>...</answer>`` tag. Each sample scores 1.0 or 0.0 and its episode ends.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, Optional

import torch
from math_verify import parse, verify
from sympy import Basic, srepr

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.common import (
    batch_success_metrics,
    last_assistant_content,
    tagged_text,
)
from nemo_rl.environments.config import MathEnvConfig
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn


def _timeout(seconds: int) -> Optional[int]:
    """math-verify's limits use SIGALRM, which only the main thread may set: None elsewhere."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return None
    return seconds


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str, timeout_s: int) -> tuple[Any, ...]:
    """Parse a ground truth given bare (``"0.5"``, ``"\\sqrt{2}"``) or in LaTeX math mode.
    Memoized: a prompt's ground truth is judged once per response."""
    for text in (ground_truth, f"${ground_truth}$", f"\\boxed{{{ground_truth}}}"):
        gold = parse(text, parsing_timeout=_timeout(timeout_s))
        if gold:
            return tuple(gold)
    raise ValueError(
        f"math-verify cannot parse the ground truth {ground_truth!r}; fix the dataset's "
        "answer field (extra_env_info['ground_truth'])"
    )


@functools.lru_cache(maxsize=8192)
def verify_answer(
    response: str, ground_truth: str, timeout_s: int = 5
) -> tuple[bool, Optional[str]]:
    """Judge one response against a ground truth. Memoized per process (8192 entries): a
    group's responses, and a converging policy's across steps, repeat, and each judgement
    parses both texts with math-verify.

    Args:
        response: the model's text.
        ground_truth: the reference answer (a number or LaTeX expression).
        timeout_s: seconds math-verify may spend on parsing and on comparing (0: no limit).

    Returns:
        ``(correct, extracted)``: whether the answers are equivalent, and the answer found in
        the response (math-verify's normalized text) or None when there is none.

    Raises:
        ValueError: the ground truth cannot be parsed.
    """
    gold = _parse_gold(str(ground_truth), timeout_s)
    inner = tagged_text(response, "answer")
    predicted = parse(inner if inner is not None else response, parsing_timeout=_timeout(timeout_s))
    if not predicted:
        return False, None
    extracted = str(predicted[-1]) if isinstance(predicted[-1], str) else str(predicted[0])
    return _equivalent(gold, tuple(predicted), timeout_s), extracted


def _exact_key(parsed: tuple[Any, ...]) -> tuple[str, ...]:
    """What identifies a parse exactly: sympy's constructor form of each expression (``srepr``:
    ``Integer(1)`` and ``Float('1.0', precision=53)`` differ), the type and text of the rest."""
    return tuple(srepr(x) if isinstance(x, Basic) else f"{type(x).__name__}:{x!r}" for x in parsed)


_EQUIVALENT: dict[tuple[tuple[str, ...], tuple[str, ...]], bool] = {}
_EQUIVALENT_MAX = 8192


def _equivalent(gold: tuple[Any, ...], predicted: tuple[Any, ...], timeout_s: int) -> bool:
    """math-verify's ``verify``, memoized on both parses: differently worded responses often
    reach the same answer, and comparing two expressions can mean a sympy simplification."""
    key = (_exact_key(gold), _exact_key(predicted))
    same = _EQUIVALENT.get(key)
    if same is None:
        same = bool(verify(list(gold), list(predicted), timeout_seconds=_timeout(timeout_s)))
        if len(_EQUIVALENT) >= _EQUIVALENT_MAX:
            _EQUIVALENT.clear()
        _EQUIVALENT[key] = same
    return same


def _verify_many(pairs: list[tuple[str, str]], timeout_s: int) -> list[tuple[bool, Optional[str]]]:
    return [verify_answer(response, truth, timeout_s) for response, truth in pairs]


class MathEnvironment(EnvironmentInterface):
    """Judges math answers; usable in-process or as a Ray actor (see ``remote_environment``).

    Metadata per sample: ``{"ground_truth": str}``.
    """

    default_processor = "math"
    required_fields = ("answer",)
    returns_answers = True

    def __init__(self, cfg: Optional[MathEnvConfig] = None) -> None:
        self.cfg = cfg or MathEnvConfig()
        self._pool: Optional[ProcessPoolExecutor] = None

    def _judge(self, pairs: list[tuple[str, str]]) -> list[tuple[bool, Optional[str]]]:
        workers = min(self.cfg.num_workers, len(pairs))
        if workers <= 1:
            return _verify_many(pairs, self.cfg.verify_timeout_s)
        if self._pool is None:
            # spawn: forking a Ray worker (threads, sockets) is unsafe.
            self._pool = ProcessPoolExecutor(self.cfg.num_workers, mp_context=get_context("spawn"))
        chunks = [pairs[w::workers] for w in range(workers)]
        futures = [self._pool.submit(_verify_many, c, self.cfg.verify_timeout_s) for c in chunks]
        results: list[Any] = [None] * len(pairs)
        for w, future in enumerate(futures):
            results[w::workers] = future.result()
        return results

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Score each conversation's last assistant turn: reward 1.0 if it matches
        ``metadata[i]["ground_truth"]``, else 0.0; every episode ends.

        Raises:
            KeyError: a sample's metadata has no ``ground_truth``.
        """
        pairs = []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            if "ground_truth" not in (meta or {}):
                raise KeyError(
                    f"sample {i}: metadata has no 'ground_truth' (keys: {sorted(meta or {})}); "
                    "the math task's data processor must set extra_env_info['ground_truth']"
                )
            pairs.append((last_assistant_content(log), str(meta["ground_truth"])))
        judged = self._judge(pairs)
        size = len(pairs)
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": "correct" if ok else "incorrect"}
                for ok, _ in judged
            ],
            metadata=[None] * size,
            next_stop_strings=[self.cfg.stop_strings] * size,
            rewards=torch.tensor([1.0 if ok else 0.0 for ok, _ in judged], dtype=torch.float32),
            terminateds=torch.ones(size, dtype=torch.bool),
            answers=[answer for _, answer in judged],
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """``accuracy`` (reward 1) and ``pass@k`` over ``batch["idx"]`` groups; batch unchanged."""
        return batch, batch_success_metrics(batch)

    def shutdown(self) -> None:
        """Stop the verification processes, if any were started."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
