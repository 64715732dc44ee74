"""Clipped policy-gradient loss (PPO/GRPO/DAPO/GSPO family) with KL to a reference policy.

Per valid token t of sequence b (``lp`` = current policy logprob, ``prev`` = policy logprob at
rollout time as recomputed by the trainer, ``gen`` = what the inference engine reported,
``ref`` = reference policy, ``A`` = advantage):

- ratio ``r = exp(lp - prev)``; with ``sequence_level_importance_ratios`` (GSPO)
  ``r = exp(mean over the sequence's valid tokens of (lp - prev))``, shared by its tokens.
- clipped objective with separate bounds (clip-higher):
  ``pg = max(-r * A, -clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max) * A)``;
  dual clip (``ratio_clip_c = c > 1``): for ``A < 0``, ``pg = min(pg, c * |A|)``.
- KL penalty ``beta * kl`` with ``kl = k1|k2|k3(lp, ref)`` (see ``_common.kl_estimate``);
  with ``use_on_policy_kl_approximation`` it is weighted by ``exp(lp - prev)`` (gradient
  flows through the weight, so the gradient estimates that of KL(pi_theta || pi_ref)).
- engine/trainer mismatch correction: with ``use_importance_sampling_correction`` each
  token's loss is multiplied by ``w = exp(prev - gen)`` (no gradient), capped at
  ``truncated_importance_sampling_ratio`` when set (TIS). ``importance_sampling_token_mask_range``
  drops tokens whose ``exp(prev - gen)`` is outside ``[low, high]``;
  ``importance_sampling_seq_mask_range`` drops whole sequences whose geometric-mean ratio
  ``exp(mean(prev - gen))`` is outside ``[low, high]``. Dropped tokens contribute 0 but stay in
  the normalising counts (the global counts are fixed before the loss runs).
- ``force_on_policy_ratio``: use ``prev = lp.detach()`` (one optimiser step per rollout), so
  the ratio is exactly 1 with the gradient of ``lp``.

The loss is ``aggregate(w * (pg + beta * kl))`` as a token-level or sequence-level loss
(``token_level_loss``), see ``_common.aggregate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field, model_validator

from nemo_rl.algorithms.loss._common import (
    KLType,
    aggregate,
    data_tensor,
    global_count,
    global_token_mean,
    kl_estimate,
    logprob_input,
    per_sequence_mean,
    sample_mask,
    valid_token_mask,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
from nemo_rl.utils.config import ConfigModel, as_config

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class ClippedPGLossConfig(ConfigModel):
    """Configuration of :class:`ClippedPGLossFn` (the ``loss_fn`` section of a GRPO recipe)."""

    reference_policy_kl_penalty: float = Field(
        default=0.01,
        ge=0.0,
        description="Coefficient beta of the KL(policy || reference) term; 0 disables it (no "
        "reference logprobs needed).",
    )
    ratio_clip_min: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description="Lower clip epsilon in [0, 1): the probability ratio is kept >= "
        "1 - ratio_clip_min.",
    )
    ratio_clip_max: float = Field(
        default=0.2,
        ge=0.0,
        description="Upper clip epsilon >= 0: the probability ratio is kept <= 1 + ratio_clip_max.",
    )
    ratio_clip_c: float | None = Field(
        default=None,
        gt=1.0,
        description="Dual-clip bound c > 1 on the loss of negative-advantage tokens (c * |A|). "
        "None: off.",
    )
    use_on_policy_kl_approximation: bool = Field(
        default=False,
        description="Weight the per-token KL by the importance ratio exp(lp - prev) so it "
        "estimates the KL of the current policy rather than the behaviour policy.",
    )
    use_importance_sampling_correction: bool = Field(
        default=False,
        description="Weight each token's loss by exp(prev - gen) (no gradient) to correct for "
        "the mismatch between generation (vLLM) and training logprobs.",
    )
    token_level_loss: bool = Field(
        default=True,
        description="True: token-level loss (normalised by the global valid tokens); False: "
        "sequence-level (per-sequence means, normalised by the global valid sequences).",
    )
    reference_policy_kl_type: KLType = Field(
        default="k3",
        description="KL estimator on d = lp - ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d "
        "(unbiased, non-negative).",
    )
    kl_clamp_value: float | None = Field(
        default=None,
        gt=0.0,
        description="Clamp lp - ref to [-v, v] before the KL estimator so k3 cannot overflow. "
        "None: no clamp.",
    )
    sequence_level_importance_ratios: bool = Field(
        default=False,
        description="GSPO: one importance ratio per sequence, exp of the mean token log-ratio "
        "over its valid tokens, instead of one per token.",
    )
    truncated_importance_sampling_ratio: float | None = Field(
        default=None,
        gt=0.0,
        description="Cap of the mismatch weight exp(prev - gen) (truncated importance "
        "sampling); needs use_importance_sampling_correction. None: no cap.",
    )
    importance_sampling_token_mask_range: list[float] | None = Field(
        default=None,
        description="[low, high], 0 <= low < high: tokens whose exp(prev - gen) lies outside are "
        "dropped from the loss (still counted in the normaliser). None: off.",
    )
    importance_sampling_seq_mask_range: list[float] | None = Field(
        default=None,
        description="[low, high], 0 <= low < high: sequences whose exp(mean(prev - gen)) lies "
        "outside are dropped from the loss. None: off.",
    )
    force_on_policy_ratio: bool = Field(
        default=False,
        description="Use the current logprobs (detached) as prev: the ratio is exactly 1, the "
        "on-policy shortcut for one optimizer step per rollout.",
    )

    @model_validator(mode="after")
    def _check(self) -> ClippedPGLossConfig:
        for name in ("importance_sampling_token_mask_range", "importance_sampling_seq_mask_range"):
            rng = getattr(self, name)
            if rng is not None and (len(rng) != 2 or not 0.0 <= rng[0] < rng[1]):
                raise ValueError(f"{name} must be [low, high] with 0 <= low < high, got {rng}")
        if (
            self.truncated_importance_sampling_ratio is not None
            and not self.use_importance_sampling_correction
        ):
            raise ValueError(
                "truncated_importance_sampling_ratio caps the importance-sampling weight, which "
                "is off; set use_importance_sampling_correction=true or the cap to null"
            )
        return self


_OWNER = "ClippedPGLossFn"
_BS = "[batch, seq]"


class ClippedPGLossFn:
    """Clipped policy-gradient loss with KL regularisation; see the module docstring.

    Input: ``next_token_logprobs`` [B, S]. Data keys: ``advantages``, ``prev_logprobs``,
    ``generation_logprobs`` [B, S] (float), ``token_mask`` [B, S], ``sample_mask`` [B], and
    ``reference_policy_logprobs`` [B, S] when ``reference_policy_kl_penalty > 0``.

    Metrics (all additive over micro-batches; token means divide by ``global_valid_toks`` over
    ``token_mask * sample_mask``): ``loss``; ``probs_ratio`` and ``probs_ratio_clamped`` (mean
    ratio before/after clipping); ``clip_fraction_low``/``clip_fraction_high`` (fraction of
    tokens with ratio below ``1 - ratio_clip_min`` / above ``1 + ratio_clip_max``);
    ``dual_clip_fraction`` (tokens whose loss the dual clip bounded); ``kl_penalty`` (beta times
    the token mean of the, possibly ratio-weighted, KL); ``approx_kl`` (k3 estimate of
    KL(prev || current)); ``approx_entropy`` (importance-weighted estimate of the current
    policy's entropy from the sampled tokens, nats/token); ``token_mult_prob_error`` (token mean
    of exp(|prev - gen|): 1 when trainer and engine agree, > 1 otherwise); ``gen_kl_error`` (k3
    estimate of KL(engine || trainer)); ``sampling_importance_ratio`` (mean mismatch weight
    applied, 1 when the correction is off); ``is_masked_fraction`` (fraction of tokens dropped
    by the mismatch masks); ``num_valid_samples`` (count of samples with sample_mask 1).
    """

    input_type = LossInputType.LOGPROB

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any]) -> None:
        """``cfg``: the config model, or a mapping of its keys (NeMo RL's calling convention),
        validated into one; missing keys take the model's defaults."""
        self.cfg = as_config(cfg, ClippedPGLossConfig, owner=_OWNER)
        self.loss_type = (
            LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        )

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global loss and additive metrics (see the class docstring)."""
        c = self.cfg
        lp = logprob_input(kwargs, _OWNER)
        shape = tuple(lp.shape)
        seqs = global_count(global_valid_seqs, "global_valid_seqs")
        toks = global_count(global_valid_toks, "global_valid_toks")
        mask = valid_token_mask(data, shape[0], shape[1], lp.dtype)
        advantages = data_tensor(data, "advantages", shape, _BS, floating=True).to(lp.dtype)
        data_prev = data_tensor(data, "prev_logprobs", shape, _BS, floating=True).to(lp.dtype)
        gen = data_tensor(data, "generation_logprobs", shape, _BS, floating=True).to(lp.dtype)
        prev = lp.detach() if c.force_on_policy_ratio else data_prev

        # Clipped surrogate.
        log_ratio = lp - prev
        if c.sequence_level_importance_ratios:
            log_ratio = per_sequence_mean(log_ratio, mask)[:, None].expand(shape)
        ratio = torch.exp(log_ratio)
        ratio_clamped = ratio.clamp(1.0 - c.ratio_clip_min, 1.0 + c.ratio_clip_max)
        pg = torch.maximum(-advantages * ratio, -advantages * ratio_clamped)
        dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
        if c.ratio_clip_c is not None:
            bound = -c.ratio_clip_c * advantages
            dual_clipped = (advantages < 0) & (pg > bound)
            pg = torch.where(dual_clipped, bound, pg)

        # KL to the reference policy.
        kl = torch.zeros_like(lp)
        if c.reference_policy_kl_penalty > 0:
            ref = data_tensor(data, "reference_policy_logprobs", shape, _BS, floating=True).to(lp.dtype)
            kl = kl_estimate(lp, ref, c.reference_policy_kl_type, c.kl_clamp_value)
            if c.use_on_policy_kl_approximation:
                kl = torch.exp(lp - prev) * kl

        # Engine/trainer mismatch correction (no gradient: prev and gen are data).
        mismatch_log = (prev - gen).detach()
        weight = torch.ones_like(mismatch_log)
        if c.use_importance_sampling_correction:
            weight = torch.exp(mismatch_log)
            if c.truncated_importance_sampling_ratio is not None:
                weight = weight.clamp_max(c.truncated_importance_sampling_ratio)
        keep = torch.ones_like(mask)
        if c.importance_sampling_token_mask_range is not None:
            low, high = c.importance_sampling_token_mask_range
            token_ratio = torch.exp(mismatch_log)
            keep = keep * ((token_ratio >= low) & (token_ratio <= high)).to(mask.dtype)
        if c.importance_sampling_seq_mask_range is not None:
            low, high = c.importance_sampling_seq_mask_range
            seq_ratio = torch.exp(per_sequence_mean(mismatch_log, mask))
            keep = keep * ((seq_ratio >= low) & (seq_ratio <= high)).to(mask.dtype)[:, None]
        loss_mask = mask * keep

        per_token = weight * (pg + c.reference_policy_kl_penalty * kl)
        loss = aggregate(per_token, loss_mask, self.loss_type, seqs, toks, count_mask=mask)

        with torch.no_grad():

            def token_mean(values: torch.Tensor) -> float:
                return float(global_token_mean(values.to(lp.dtype), mask, toks))

            metrics: dict[str, Any] = {
                "loss": float(loss.detach()),
                "probs_ratio": token_mean(ratio),
                "probs_ratio_clamped": token_mean(ratio_clamped),
                "clip_fraction_low": token_mean(ratio < 1.0 - c.ratio_clip_min),
                "clip_fraction_high": token_mean(ratio > 1.0 + c.ratio_clip_max),
                "dual_clip_fraction": token_mean(dual_clipped),
                "kl_penalty": c.reference_policy_kl_penalty * token_mean(kl),
                "approx_kl": token_mean(kl_estimate(prev, lp, "k3")),
                "approx_entropy": token_mean(-torch.exp(lp - gen) * lp),
                "token_mult_prob_error": token_mean(torch.exp((data_prev - gen).abs())),
                "gen_kl_error": token_mean(kl_estimate(gen, data_prev, "k3")),
                "sampling_importance_ratio": token_mean(weight),
                "is_masked_fraction": token_mean(1.0 - keep),
                "num_valid_samples": float(sample_mask(data, shape[0], lp.dtype).sum()),
            }
        return loss, metrics
