"""Helpers shared by the losses: input checks, masks, global normalisation, KL estimators.

Shapes use ``B`` for batch (sequences), ``S`` for sequence length (tokens), ``K`` for top-k
and ``V`` for vocabulary size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import torch

from nemo_rl.algorithms.loss.interfaces import LossType

KLType = Literal["k1", "k2", "k3"]
KL_TYPES: tuple[str, ...] = get_args(KLType)


# ------------------------------------------------------------------------------ input checks


def take_inputs(kwargs: Mapping[str, Any], names: Sequence[str], owner: str) -> list[Any]:
    """Return the model outputs ``names`` from the loss's ``**kwargs``, in that order.

    Raises ``TypeError`` when one is missing or an unexpected one is given.
    """
    missing = [n for n in names if n not in kwargs]
    extra = sorted(set(kwargs) - set(names))
    if missing or extra:
        raise TypeError(
            f"{owner} expects exactly the keyword inputs {list(names)}; missing {missing}, unexpected {extra}"
        )
    return [kwargs[n] for n in names]


def per_token_input(kwargs: Mapping[str, Any], name: str, owner: str) -> torch.Tensor:
    """The model output ``name``, a [B, S] float tensor (the loss's only keyword input), checked."""
    (value,) = take_inputs(kwargs, (name,), owner)
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"'{name}' must be a tensor of shape [batch, seq], got {got}")
    return check_tensor(value, name, tuple(value.shape), "[batch, seq]", floating=True)


def logprob_input(kwargs: Mapping[str, Any], owner: str) -> torch.Tensor:
    """The ``next_token_logprobs`` [B, S] float input of a LOGPROB loss, checked."""
    return per_token_input(kwargs, "next_token_logprobs", owner)


def check_tensor(
    value: Any,
    name: str,
    shape: Sequence[int],
    dims: str,
    *,
    floating: bool,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of ``shape`` (described by ``dims``, e.g. "[batch, seq]").

    ``floating=True`` requires a floating dtype; otherwise bool, integer or floating masks are
    accepted. Raises ``ValueError`` naming the input and the expected shape.
    """
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"'{name}' must be a torch.Tensor of shape {dims}={list(shape)}, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"'{name}' must have shape {dims}={list(shape)}, got {list(value.shape)}")
    if floating and not value.is_floating_point():
        raise ValueError(f"'{name}' must be a floating-point tensor, got dtype {value.dtype}")
    return value


def data_tensor(
    data: Mapping[str, Any],
    key: str,
    shape: Sequence[int],
    dims: str,
    *,
    floating: bool,
) -> torch.Tensor:
    """Fetch ``data[key]`` and check it with :func:`check_tensor`."""
    if key not in data:
        raise ValueError(f"data is missing key '{key}' (expected shape {dims}={list(shape)})")
    return check_tensor(data[key], key, shape, dims, floating=floating)


def valid_token_mask(data: Mapping[str, Any], batch: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """``token_mask * sample_mask[:, None]`` as ``dtype``: [B, S], 1 on tokens that count."""
    token_mask = data_tensor(data, "token_mask", (batch, seq), "[batch, seq]", floating=False)
    return token_mask.to(dtype) * sample_mask(data, batch, dtype)[:, None]


def sample_mask(data: Mapping[str, Any], batch: int, dtype: torch.dtype) -> torch.Tensor:
    """``data['sample_mask']`` as ``dtype``: [B], 0 drops a whole sample."""
    return data_tensor(data, "sample_mask", (batch,), "[batch]", floating=False).to(dtype)


def global_count(value: torch.Tensor | float | int, name: str) -> torch.Tensor:
    """Validate a global count (a scalar >= 0) and return it as a tensor."""
    count = torch.as_tensor(value)
    if count.numel() != 1:
        raise ValueError(f"'{name}' must be a scalar count, got shape {list(count.shape)}")
    count = count.reshape(())
    if bool(count < 0):
        raise ValueError(f"'{name}' must be >= 0, got {count.item()}")
    return count


# --------------------------------------------------------------------------- normalisation


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, and 0 where the denominator is 0 (nothing was valid)."""
    denominator = denominator.to(numerator.dtype)
    positive = denominator > 0
    return torch.where(positive, numerator / torch.where(positive, denominator, 1.0), 0.0)


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero (``values`` elsewhere is ignored, even NaN)."""
    selected = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim)


def global_token_mean(values: torch.Tensor, mask: torch.Tensor, global_valid_toks: torch.Tensor) -> torch.Tensor:
    """Micro-batch share of a token mean: sum of masked ``values`` [B, S] / ``global_valid_toks``."""
    return safe_divide(masked_sum(values, mask), global_valid_toks)


def global_token_means(
    values: Sequence[torch.Tensor], mask: torch.Tensor, global_valid_toks: torch.Tensor
) -> torch.Tensor:
    """``[k]`` micro-batch shares of the token means of ``k`` tensors, each ``[B, S]`` (or
    broadcastable to it): :func:`global_token_mean` of each, computed in one masked reduction
    of the stacked ``[k, B, S]`` values (one kernel chain instead of ``k``)."""
    stacked = torch.stack([v.to(mask.dtype).expand_as(mask) for v in values])
    return safe_divide(masked_sum(stacked, mask, dim=(-2, -1)), global_valid_toks)


def per_sequence_mean(values: torch.Tensor, mask: torch.Tensor, count_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of each sequence: [B, S] -> [B].

    The numerator sums ``values`` under ``mask``; the denominator counts ``count_mask``
    (default ``mask``), clamped to 1 so a sequence without valid tokens gives 0.
    """
    count_mask = mask if count_mask is None else count_mask
    return masked_sum(values, mask, dim=-1) / count_mask.sum(-1).clamp_min(1)


def aggregate(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_type: LossType,
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
    count_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, S] to the micro-batch's share of the global loss.

    TOKEN_LEVEL: sum over ``loss_mask`` / ``global_valid_toks``.
    SEQUENCE_LEVEL: per-sequence mean (numerator over ``loss_mask``, token count from
    ``count_mask``, default ``loss_mask``) summed over sequences / ``global_valid_seqs``.
    A sequence whose tokens are all masked contributes 0.
    """
    if loss_type is LossType.TOKEN_LEVEL:
        return global_token_mean(per_token, loss_mask, global_valid_toks)
    return safe_divide(per_sequence_mean(per_token, loss_mask, count_mask).sum(), global_valid_seqs)


# ----------------------------------------------------------------------------- estimators


def kl_estimate(
    logprobs: torch.Tensor,
    other_logprobs: torch.Tensor,
    kl_type: str,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(p || q) from tokens sampled from p.

    ``logprobs`` = log p(token), ``other_logprobs`` = log q(token), same shape. With
    ``d = log p - log q``: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (Schulman's estimators;
    k1 and k3 are unbiased for KL(p || q), k2 is low-variance but biased; k2 and k3 are >= 0).
    ``clamp`` limits ``d`` to [-clamp, clamp] first, which keeps k3's exponential finite.
    """
    log_ratio = logprobs - other_logprobs
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def js_divergence_estimate(logprobs: torch.Tensor, other_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of the Jensen-Shannon divergence between p and q from sampled tokens.

    ``logprobs`` = log p(token), ``other_logprobs`` = log q(token), same shape. With the
    mixture ``log m = log((p + q) / 2)`` and ``f(x) = exp(x) - 1 - x`` (the k3 form):
    ``0.5 * f(log p - log m) + 0.5 * f(log q - log m)``; 0 where p = q, >= 0 everywhere.
    """
    log_ratio = other_logprobs - logprobs
    # log m - log p, formed relative to p so that p = q gives exactly 0
    mixture_rel = torch.logaddexp(torch.zeros_like(log_ratio), log_ratio) - math.log(2.0)

    def k3_form(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x) - 1.0 - x

    return 0.5 * k3_form(-mixture_rel) + 0.5 * k3_form(log_ratio - mixture_rel)
