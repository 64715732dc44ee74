"""Small helpers the environments share: reading the latest turn and success metrics."""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.interfaces import REWARD_COMPONENT_PREFIX, EnvironmentReturn


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


def split_rewards(
    rewards: torch.Tensor | dict[str, torch.Tensor], size: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An :attr:`EnvironmentReturn.rewards` as ``(total [size] float32, {"reward/<name>":
    [size] float32})``: a single reward tensor has no components, a dict's total is the sum of
    its components.

    Raises:
        ValueError: not a ``[size]`` tensor, or a dict that is empty, has a key without the
            ``reward/`` prefix or a value that is not a ``[size]`` tensor (names the key).
    """
    if isinstance(rewards, dict):
        if not rewards:
            raise ValueError("rewards is an empty dict; return {'reward/<name>': [B] tensor, ...}")
        components = {}
        for key, value in sorted(rewards.items()):
            if not isinstance(key, str) or not key.startswith(REWARD_COMPONENT_PREFIX):
                raise ValueError(
                    f"rewards key {key!r} lacks the {REWARD_COMPONENT_PREFIX!r} prefix; name "
                    f"each reward component '{REWARD_COMPONENT_PREFIX}<name>'"
                )
            components[key] = _reward_tensor(value, size, f"rewards[{key!r}]")
        return torch.stack(list(components.values())).sum(0), components
    return _reward_tensor(rewards, size, "rewards"), {}


def _reward_tensor(value: Any, size: int, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (size,):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where} must be a tensor of shape ({size},), got {got}")
    return value.to(torch.float32)


def final_step_return(
    rewards: torch.Tensor | dict[str, torch.Tensor],
    answers: Optional[list[Optional[str]]] = None,
) -> EnvironmentReturn:
    """Every sample's episode ends with ``rewards[i]`` (``[B]`` float32, or a dict of named
    ``[B]`` rewards, :func:`split_rewards`) and ``answers[i]`` (None: no answers) and nothing
    more: an empty observation, no metadata or stop strings."""
    first = next(iter(rewards.values())) if isinstance(rewards, dict) else rewards
    size = int(first.numel())
    if isinstance(rewards, dict):
        rewards = {key: value.to(torch.float32) for key, value in rewards.items()}
    else:
        rewards = rewards.to(torch.float32)
    return EnvironmentReturn(
        observations=[{"role": "environment", "content": ""} for _ in range(size)],
        metadata=[None] * size,
        next_stop_strings=[None] * size,
        rewards=rewards,
        terminateds=torch.ones(size, dtype=torch.bool),
        answers=[None] * size if answers is None else list(answers),
    )
