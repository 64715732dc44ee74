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
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch

from nemo_rl.algorithms.loss._common import (
    KL_TYPES,
    aggregate,
    check_range,
    config_to_dict,
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

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class ClippedPGLossConfig(TypedDict):
    """Configuration of :class:`ClippedPGLossFn` (``loss_fn`` section of a GRPO config)."""

    reference_policy_kl_penalty: float
    """Coefficient beta of the KL-to-reference term; 0 disables it (no reference logprobs needed)."""
    ratio_clip_min: float
    """Lower clip epsilon: the ratio is clipped at ``1 - ratio_clip_min``; in [0, 1)."""
    ratio_clip_max: float
    """Upper clip epsilon: the ratio is clipped at ``1 + ratio_clip_max``; >= 0."""
    ratio_clip_c: float | None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at c*|A|; None disables."""
    use_on_policy_kl_approximation: bool
    """Weight the per-token KL by the importance ratio exp(lp - prev)."""
    use_importance_sampling_correction: bool
    """Weight each token's loss by exp(prev - gen) to correct for the engine/trainer mismatch."""
    token_level_loss: bool
    """True: token-level loss (normalised by global valid tokens); False: sequence-level."""
    reference_policy_kl_type: NotRequired[str]
    """KL estimator: "k1", "k2" or "k3" (default "k3")."""
    kl_clamp_value: NotRequired[float | None]
    """Clamp the log-ratio lp - ref to [-v, v] before the KL estimator (default None: no clamp)."""
    sequence_level_importance_ratios: NotRequired[bool]
    """GSPO: one ratio per sequence, exp(mean of lp - prev over its tokens) (default False)."""
    truncated_importance_sampling_ratio: NotRequired[float | None]
    """Cap of the mismatch weight exp(prev - gen) (TIS); needs use_importance_sampling_correction."""
    importance_sampling_token_mask_range: NotRequired[tuple[float, float] | None]
    """Drop tokens whose exp(prev - gen) lies outside [low, high] (default None)."""
    importance_sampling_seq_mask_range: NotRequired[tuple[float, float] | None]
    """Drop sequences whose exp(mean(prev - gen)) lies outside [low, high] (default None)."""
    force_on_policy_ratio: NotRequired[bool]
    """Use lp.detach() as prev: ratio exactly 1 (one optimiser step per rollout) (default False)."""


_REQUIRED = (
    "reference_policy_kl_penalty",
    "ratio_clip_min",
    "ratio_clip_max",
    "ratio_clip_c",
    "use_on_policy_kl_approximation",
    "use_importance_sampling_correction",
    "token_level_loss",
)
_DEFAULTS: dict[str, Any] = {
    "reference_policy_kl_type": "k3",
    "kl_clamp_value": None,
    "sequence_level_importance_ratios": False,
    "truncated_importance_sampling_ratio": None,
    "importance_sampling_token_mask_range": None,
    "importance_sampling_seq_mask_range": None,
    "force_on_policy_ratio": False,
}
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
        c = config_to_dict(cfg, owner=_OWNER, required=_REQUIRED, defaults=_DEFAULTS)
        self.kl_penalty = float(c["reference_policy_kl_penalty"])
        self.clip_low = float(c["ratio_clip_min"])
        self.clip_high = float(c["ratio_clip_max"])
        self.clip_c = None if c["ratio_clip_c"] is None else float(c["ratio_clip_c"])
        self.on_policy_kl = bool(c["use_on_policy_kl_approximation"])
        self.is_correction = bool(c["use_importance_sampling_correction"])
        self.kl_type = str(c["reference_policy_kl_type"])
        self.kl_clamp = None if c["kl_clamp_value"] is None else float(c["kl_clamp_value"])
        self.sequence_ratios = bool(c["sequence_level_importance_ratios"])
        cap = c["truncated_importance_sampling_ratio"]
        self.is_cap = None if cap is None else float(cap)
        token_key, seq_key = "importance_sampling_token_mask_range", "importance_sampling_seq_mask_range"
        self.token_mask_range = check_range(_OWNER, token_key, c[token_key])
        self.seq_mask_range = check_range(_OWNER, seq_key, c[seq_key])
        self.force_on_policy = bool(c["force_on_policy_ratio"])
        self.loss_type = LossType.TOKEN_LEVEL if c["token_level_loss"] else LossType.SEQUENCE_LEVEL
        self._validate()

    def _validate(self) -> None:
        if self.kl_penalty < 0:
            raise ValueError(f"{_OWNER}: reference_policy_kl_penalty must be >= 0, got {self.kl_penalty}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"{_OWNER}: ratio_clip_min must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"{_OWNER}: ratio_clip_max must be >= 0, got {self.clip_high}")
        if self.clip_c is not None and self.clip_c <= 1.0:
            raise ValueError(f"{_OWNER}: ratio_clip_c must be > 1 (or None to disable), got {self.clip_c}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"{_OWNER}: reference_policy_kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"{_OWNER}: kl_clamp_value must be > 0 or None, got {self.kl_clamp}")
        if self.is_cap is not None and (self.is_cap <= 0 or not self.is_correction):
            raise ValueError(
                f"{_OWNER}: truncated_importance_sampling_ratio must be > 0 and needs "
                f"use_importance_sampling_correction=True, got {self.is_cap}"
            )

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global loss and additive metrics (see the class docstring)."""
        lp = logprob_input(kwargs, _OWNER)
        shape = tuple(lp.shape)
        seqs = global_count(global_valid_seqs, "global_valid_seqs")
        toks = global_count(global_valid_toks, "global_valid_toks")
        mask = valid_token_mask(data, shape[0], shape[1], lp.dtype)
        advantages = data_tensor(data, "advantages", shape, _BS, floating=True).to(lp.dtype)
        data_prev = data_tensor(data, "prev_logprobs", shape, _BS, floating=True).to(lp.dtype)
        gen = data_tensor(data, "generation_logprobs", shape, _BS, floating=True).to(lp.dtype)
        prev = lp.detach() if self.force_on_policy else data_prev

        # Clipped surrogate.
        log_ratio = lp - prev
        if self.sequence_ratios:
            log_ratio = per_sequence_mean(log_ratio, mask)[:, None].expand(shape)
        ratio = torch.exp(log_ratio)
        ratio_clamped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        pg = torch.maximum(-advantages * ratio, -advantages * ratio_clamped)
        dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
        if self.clip_c is not None:
            bound = -self.clip_c * advantages
            dual_clipped = (advantages < 0) & (pg > bound)
            pg = torch.where(dual_clipped, bound, pg)

        # KL to the reference policy.
        kl = torch.zeros_like(lp)
        if self.kl_penalty > 0:
            ref = data_tensor(data, "reference_policy_logprobs", shape, _BS, floating=True).to(lp.dtype)
            kl = kl_estimate(lp, ref, self.kl_type, self.kl_clamp)
            if self.on_policy_kl:
                kl = torch.exp(lp - prev) * kl

        # Engine/trainer mismatch correction (no gradient: prev and gen are data).
        mismatch_log = (prev - gen).detach()
        weight = torch.ones_like(mismatch_log)
        if self.is_correction:
            weight = torch.exp(mismatch_log)
            if self.is_cap is not None:
                weight = weight.clamp_max(self.is_cap)
        keep = torch.ones_like(mask)
        if self.token_mask_range is not None:
            low, high = self.token_mask_range
            token_ratio = torch.exp(mismatch_log)
            keep = keep * ((token_ratio >= low) & (token_ratio <= high)).to(mask.dtype)
        if self.seq_mask_range is not None:
            low, high = self.seq_mask_range
            seq_ratio = torch.exp(per_sequence_mean(mismatch_log, mask))
            keep = keep * ((seq_ratio >= low) & (seq_ratio <= high)).to(mask.dtype)[:, None]
        loss_mask = mask * keep

        per_token = weight * (pg + self.kl_penalty * kl)
        loss = aggregate(per_token, loss_mask, self.loss_type, seqs, toks, count_mask=mask)

        with torch.no_grad():

            def token_mean(values: torch.Tensor) -> float:
                return float(global_token_mean(values.to(lp.dtype), mask, toks))

            metrics: dict[str, Any] = {
                "loss": float(loss.detach()),
                "probs_ratio": token_mean(ratio),
                "probs_ratio_clamped": token_mean(ratio_clamped),
                "clip_fraction_low": token_mean(ratio < 1.0 - self.clip_low),
                "clip_fraction_high": token_mean(ratio > 1.0 + self.clip_high),
                "dual_clip_fraction": token_mean(dual_clipped),
                "kl_penalty": self.kl_penalty * token_mean(kl),
                "approx_kl": token_mean(kl_estimate(prev, lp, "k3")),
                "approx_entropy": token_mean(-torch.exp(lp - gen) * lp),
                "token_mult_prob_error": token_mean(torch.exp((data_prev - gen).abs())),
                "gen_kl_error": token_mean(kl_estimate(gen, data_prev, "k3")),
                "sampling_importance_ratio": token_mean(weight),
                "is_masked_fraction": token_mean(1.0 - keep),
                "num_valid_samples": float(sample_mask(data, shape[0], lp.dtype).sum()),
            }
        return loss, metrics
