"""The sampling distribution of vLLM written out in plain torch, the reference of the
sampling-consistent logprob tests: logits divided by the temperature, top-k (keep the k
largest), then top-p as vLLM's sampler does it (sort ascending; a token goes when the tokens at
most as likely as it hold ``1 - top_p`` of the mass or less, the most likely one always
stays), -inf outside the kept set. Importable as ``sampling_reference``."""

from __future__ import annotations

import math

import torch


def sampling_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """``[..., V]`` logits of the distribution vLLM samples from (``-inf`` where truncated)."""
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        below[..., -1] = False
        logits = logits.masked_fill(torch.zeros_like(below).scatter(-1, order, below), -math.inf)
    return logits
