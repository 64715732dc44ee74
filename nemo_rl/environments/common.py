"""Small helpers the environments share: reading the latest turn and success metrics."""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.interfaces import EnvironmentReturn


def last_assistant_content(message_log: LLMMessageLogType) -> str:
    """Text of the last assistant message of a conversation.

    Raises:
        ValueError: the conversation has no assistant message.
    """
    for message in reversed(message_log):
        if message["role"] == "assistant":
            return message["content"]
    roles = [m["role"] for m in message_log]
    raise ValueError(f"conversation has no assistant message to judge (roles: {roles})")


def tagged_text(text: str, tag: str) -> Optional[str]:
    """Inner text of the last ``<tag>...</tag>`` in ``text``, stripped, or None.

    A tag left open at the very end counts too (``"... <tag>12"`` gives ``"12"``): generation
    engines usually drop the stop string (``</tag>``) from the text they return.
    """
    matches = re.findall(rf"<{tag}>(.*?)(?:</{tag}>|\Z)", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def success_metrics(
    rewards: torch.Tensor, prompt_ids: Optional[list[Any]], threshold: float = 1.0
) -> dict[str, float]:
    """Accuracy, and pass@k when several samples share a prompt.

    Args:
        rewards: ``[B]`` total reward of each finished sample.
        prompt_ids: ``B`` prompt identities (e.g. the batch's ``idx``), or None.
        threshold: a sample with reward >= ``threshold`` counts as solved.

    Returns:
        ``accuracy`` (fraction of samples solved) and, when ``prompt_ids`` is given and every
        prompt has the same number k > 1 of samples, ``pass@k`` (fraction of prompts with at
        least one solved sample). Empty batches give ``{}``.
    """
    if rewards.numel() == 0:
        return {}
    solved = rewards.float() >= threshold
    metrics = {"accuracy": float(solved.float().mean())}
    if prompt_ids is None:
        return metrics
    groups: dict[Any, list[bool]] = {}
    for prompt, ok in zip(prompt_ids, solved.tolist()):
        groups.setdefault(prompt, []).append(ok)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) == 1 and (k := sizes.pop()) > 1:
        metrics[f"pass@{k}"] = sum(any(g) for g in groups.values()) / len(groups)
    return metrics


def batch_success_metrics(batch: Any, threshold: float = 1.0) -> dict[str, float]:
    """:func:`success_metrics` of a finished rollout batch (``total_reward`` [B], ``idx``)."""
    idx = batch["idx"] if "idx" in batch else None
    if isinstance(idx, torch.Tensor):
        idx = idx.tolist()
    return success_metrics(torch.as_tensor(batch["total_reward"]), idx, threshold)


def final_step_return(
    rewards: torch.Tensor, answers: Optional[list[Optional[str]]] = None
) -> EnvironmentReturn:
    """Every sample's episode ends with ``rewards[i]`` (``[B]`` float32) and ``answers[i]``
    (None: no answers) and nothing more: an empty observation, no metadata or stop strings."""
    size = int(rewards.numel())
    return EnvironmentReturn(
        observations=[{"role": "environment", "content": ""} for _ in range(size)],
        metadata=[None] * size,
        next_stop_strings=[None] * size,
        rewards=rewards.to(torch.float32),
        terminateds=torch.ones(size, dtype=torch.bool),
        answers=[None] * size if answers is None else list(answers),
    )
