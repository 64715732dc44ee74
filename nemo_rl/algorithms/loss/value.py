"""PPO's critic loss: clipped squared error of the value head against the GAE returns, key for
key NeMo RL's ``MseValueLossFn`` (``value_loss_fn`` section).

Per valid token t (``v`` = the critic's value now, ``v_old`` = its value at rollout time,
``R`` = the GAE return, :func:`~nemo_rl.algorithms.advantage_estimators.gae_advantages`):

- without clipping (``cliprange`` None): ``l = (v - R)^2``;
- with ``cliprange = eps``: ``v_c = clamp(v, v_old - eps, v_old + eps)`` and
  ``l = max((v - R)^2, (v_c - R)^2)``, so an update that moves a value more than ``eps`` away
  from ``v_old`` gains nothing from the move.

The loss is ``0.5 * scale * sum(l over valid tokens) / global_valid_toks`` (token-level).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from nemo_rl.algorithms.loss._common import (
    data_tensor,
    global_count,
    global_token_means,
    per_token_input,
    sample_mask,
    valid_token_mask,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType, MetricReduction
from nemo_rl.utils.config import ConfigModel, as_config

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

_OWNER = "MseValueLossFn"


class MseValueLossConfig(ConfigModel):
    """Configuration of :class:`MseValueLossFn` (the ``value_loss_fn`` section of a PPO recipe,
    NeMo RL's keys and defaults)."""

    scale: float = Field(
        default=1.0,
        ge=0.0,
        description="Coefficient of the value loss (NeMo RL's PPO recipes use 0.4).",
    )
    cliprange: float | None = Field(
        default=None,
        ge=0.0,
        description="Clip range eps of the value update: values are clamped to [v_old - eps, "
        "v_old + eps] and the larger of the clipped and unclipped squared errors is "
        "trained. None or 0: no clipping (NeMo RL's PPO recipes use 0.2).",
    )


def explained_variance(metrics: Mapping[str, float]) -> float:
    """``1 - Var(R - v) / Var(R)`` over the batch's valid tokens, from the summed metrics
    ``returns_mean``, ``values_mean``, ``returns_sq_mean`` and ``residual_sq_mean`` of
    :class:`MseValueLossFn` (population variances; ``Var(R)`` floored at 1e-8). 1: the critic
    predicts the returns exactly; 0: no better than their mean."""
    returns_var = metrics["returns_sq_mean"] - metrics["returns_mean"] ** 2
    residual_mean = metrics["returns_mean"] - metrics["values_mean"]
    residual_var = metrics["residual_sq_mean"] - residual_mean**2
    return 1.0 - residual_var / max(returns_var, 1e-8)


class MseValueLossFn:
    """Clipped value loss of the critic (see the module docstring).

    Input: ``values`` [B, S], the critic's value of the state before each token
    (:attr:`~nemo_rl.algorithms.loss.interfaces.LossInputType.VALUE`). Data keys:
    ``returns`` [B, S]; ``values`` [B, S] (rollout-time values, read only with a
    ``cliprange``); ``token_mask`` [B, S]; ``sample_mask`` [B].

    Metrics (additive over micro-batches; token means are shares of the global token mean):
    ``loss``; ``vf_clipfrac`` (fraction of valid tokens where the clipped error is the larger,
    0 without clipping); ``returns_mean``, ``values_mean``, ``returns_sq_mean`` (mean R^2),
    ``residual_sq_mean`` (mean (R - v)^2), from which :func:`explained_variance` is computed;
    ``num_valid_samples``; ``values_min`` / ``values_max``, the extremes of ``v`` over the
    valid tokens (reduced by min / max, :attr:`metric_reductions`; +inf / -inf for a
    micro-batch without valid tokens).
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.VALUE
    metric_reductions = {"values_min": MetricReduction.MIN, "values_max": MetricReduction.MAX}

    def __init__(self, cfg: MseValueLossConfig | Mapping[str, Any] | None = None) -> None:
        """``cfg``: the config model or a mapping of its keys; None: the defaults."""
        self.cfg = as_config({} if cfg is None else cfg, MseValueLossConfig, owner=_OWNER)

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global value loss and its metrics."""
        values = per_token_input(kwargs, "values", _OWNER)
        shape = tuple(values.shape)
        global_count(global_valid_seqs, "global_valid_seqs")
        toks = global_count(global_valid_toks, "global_valid_toks")
        returns = data_tensor(data, "returns", shape, "[batch, seq]", floating=True).to(values.dtype)
        mask = valid_token_mask(data, *shape, values.dtype)
        unclipped = (values - returns).square()
        cliprange = self.cfg.cliprange
        if cliprange:
            old = data_tensor(data, "values", shape, "[batch, seq]", floating=True).to(values.dtype)
            clipped = (torch.clamp(values, old - cliprange, old + cliprange) - returns).square()
            per_token = torch.maximum(unclipped, clipped)
            was_clipped = (clipped > unclipped).to(values.dtype)
        else:
            per_token, was_clipped = unclipped, torch.zeros_like(values)
        means = global_token_means(
            [per_token, was_clipped, returns, values.detach(), returns.square(), unclipped.detach()],
            mask,
            toks,
        )
        loss = 0.5 * self.cfg.scale * means[0]
        stats = means[1:].detach().tolist()
        valid = values.detach()[mask > 0]
        extremes = [float("inf"), float("-inf")]  # neutral for min / max: no valid token
        if valid.numel():
            extremes = torch.stack([valid.min(), valid.max()]).tolist()
        metrics = {
            "loss": float(loss.detach()),
            **dict(zip(("vf_clipfrac", "returns_mean", "values_mean", "returns_sq_mean", "residual_sq_mean"), stats)),
            "num_valid_samples": float(sample_mask(data, shape[0], values.dtype).sum()),
            "values_min": extremes[0],
            "values_max": extremes[1],
        }
        return loss, metrics
