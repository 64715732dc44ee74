"""The figures a GRPO step and a validation report (NeMo RL's metric names)."""

from __future__ import annotations

from typing import Any

import torch


def merge_rollout_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    """Rollout metrics of several generation batches of one step: counts and times summed
    (``total_*``, ``*_time_s``, ``env_errors``), every other figure averaged."""
    merged: dict[str, float] = {}
    for key in per_batch[0]:
        values = [m[key] for m in per_batch]
        additive = key.startswith("total_") or key.endswith("_time_s") or key == "env_errors"
        merged[key] = sum(values) if additive else sum(values) / len(values)
    return merged


def step_metrics(
    rollout_metrics: dict[str, float],
    train_results: dict[str, Any],
    data_metrics: dict[str, float],
) -> dict[str, float]:
    """One flat ``{name: value}`` of a GRPO step's figures (NeMo RL's metric names where they
    exist: ``loss``, ``grad_norm``, ``lr``, ``reward``, ``token_mult_prob_error``, ...)."""
    metrics: dict[str, float] = {
        "loss": float(train_results["loss"][-1]),
        "grad_norm": float(train_results["grad_norm"][-1]),
        "lr": float(train_results["lr"][-1]),
        "reward": rollout_metrics["reward_mean"],
    }
    for key, values in train_results["metrics"].items():
        metrics[key] = float(values[-1])
    metrics.update({f"rollout/{k}": v for k, v in rollout_metrics.items()})
    metrics.update(data_metrics)
    return metrics


def validation_metrics(rewards: list[torch.Tensor], lengths: list[float]) -> dict[str, float]:
    """A validation's metrics from its batches' ``[B]`` rewards and mean generated tokens:
    ``accuracy`` (mean reward), ``num_samples``, ``mean_generated_tokens_per_sample``."""
    all_rewards = torch.cat(rewards)
    return {
        "accuracy": float(all_rewards.mean()),
        "num_samples": float(all_rewards.numel()),
        "mean_generated_tokens_per_sample": sum(lengths) / max(len(lengths), 1),
    }
