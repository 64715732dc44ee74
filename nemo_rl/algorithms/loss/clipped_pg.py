"""Clipped policy-gradient loss (PPO / GRPO / DAPO / GSPO / REINFORCE / CISPO / VAPO) with KL
to a reference policy, key for key NeMo RL's ``ClippedPGLossFn``.

Per valid token t of sequence b (``lp`` = current policy logprob, ``prev`` = policy logprob at
rollout time as recomputed by the trainer, ``gen`` = what the inference engine reported,
``ref`` = reference policy, ``A`` = advantage, ``sg`` = stop-gradient):

- ratio ``r = exp(lp - prev)``; with ``sequence_level_importance_ratios`` (GSPO)
  ``r = exp(mean over the sequence's valid tokens of (lp - prev))``, shared by its tokens;
  with ``force_on_policy_ratio`` ``r = exp(lp - sg(lp))`` (1, with the gradient of ``lp``);
  with ``disable_ppo_ratio`` (REINFORCE) ``r = lp`` and no clipping.
- surrogate ``pg = max(-A * r, -A * clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max))``
  (clip-higher: separate bounds); CISPO (``use_cispo``):
  ``pg = -A * sg(clip(r, ...)) * lp``; dual clip (``ratio_clip_c = c > 1``): for ``A < 0``,
  ``pg = min(pg, -c * A)``.
- engine/trainer mismatch weight ``w = exp(prev - gen)`` per token, or with GSPO one weight per
  sequence ``w_b = exp(sum over its valid tokens of (prev - gen))`` (no gradient; NaN/inf -> 0).
  ``truncated_importance_sampling_type``: ``tis`` clamps ``w`` to ``[ratio_min or 0, ratio]``;
  ``icepop`` zeroes the tokens whose ``w`` lies outside ``[ratio_min, ratio]``;
  ``seq-mask-tis`` zeroes the sequences whose geometric-mean weight ``exp(mean(prev - gen))``
  lies outside, the others keep their untruncated token weights. The weight multiplies the
  surrogate only with ``use_importance_sampling_correction``.
- KL penalty ``beta * kl`` with ``kl = v * k1|k2|k3(lp_u, ref)`` (``_common.kl_estimate``),
  ``lp_u`` = ``data['curr_logprobs_unfiltered']`` when present (logprobs before top-k/top-p
  filtering, same shape as ``next_token_logprobs``), else ``lp``. The sampling weight ``v`` is
  ``exp(lp_u - sg(lp_u))`` (value 1) or, with ``use_on_policy_kl_approximation``,
  ``exp(lp_u - gen)``: either way its gradient adds the score-function term ``kl * grad(lp_u)``
  that an estimate of KL from the policy's own samples needs (arXiv:2506.09477).
  ``kl_input_clamp_value`` clamps ``lp_u - ref`` first (where it bites, ``v`` gets no gradient);
  ``kl_output_clamp_value`` clamps ``v * k`` after.
- VAPO (``positive_example_nll_weight = mu > 0``): ``mu`` times the mean of ``-lp`` over the
  micro-batch's valid tokens of samples with ``data['rewards'] > 0``.

The loss is ``aggregate(w * pg) + beta * aggregate(kl) + mu * nll`` (``beta`` 0 with
``use_kl_in_reward``: the GRPO step then puts the KL into REINFORCE++'s rewards), each ``aggregate`` a
token-level or sequence-level reduction (``token_level_loss``, see ``_common.aggregate``).

Logprob conventions (told apart by shape): ours, ``next_token_logprobs`` ``[B, S]`` aligned
with the data's ``[B, S]`` tensors (position 0 holds 0: nothing predicts the first token); or
NeMo RL's, ``[B, S - 1]`` aligned with ``data[:, 1:]`` (the loss then reads the data's token
fields from position 1 on). Both give the same loss when ``token_mask[:, 0]`` is 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator

from nemo_rl.algorithms.loss._common import (
    KLType,
    aggregate,
    check_tensor,
    data_tensor,
    global_count,
    global_token_mean,
    global_token_means,
    js_divergence_estimate,
    kl_estimate,
    logprob_input,
    masked_sum,
    per_sequence_mean,
    safe_divide,
    sample_mask,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
from nemo_rl.utils.config import ConfigModel, as_config

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

TruncatedISType = Literal["tis", "icepop", "seq-mask-tis"]


class ClippedPGLossConfig(ConfigModel):
    """Configuration of :class:`ClippedPGLossFn` (the ``loss_fn`` section of a GRPO recipe).

    Keys and meanings are NeMo RL's; a NeMo RL ``loss_fn`` section validates as is (its
    ``kl_*_clamp_value`` defaults are 20 / 10 in NeMo RL's model, off here: its recipes state
    them).
    """

    reference_policy_kl_penalty: float = Field(
        default=0.01,
        ge=0.0,
        description="Coefficient beta of the KL(policy || reference) term; 0 disables it (no "
        "reference logprobs needed).",
    )
    reference_policy_kl_type: KLType = Field(
        default="k3",
        description="KL estimator on d = lp - ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d "
        "(unbiased, non-negative). Also the estimator of the gen_kl_error / policy_kl_error "
        "metrics.",
    )
    kl_input_clamp_value: float | None = Field(
        default=None,
        gt=0.0,
        description="Clamp lp - ref to [-v, v] before the KL estimator so k3 cannot overflow; "
        "where it clamps, the KL's sampling weight gets no gradient. None: no clamp (NeMo RL "
        "recipes use 20).",
    )
    kl_output_clamp_value: float | None = Field(
        default=None,
        gt=0.0,
        description="Clamp each token's (weighted) KL estimate to [-v, v]. None: no clamp "
        "(NeMo RL recipes use 10).",
    )
    use_kl_in_reward: bool = Field(
        default=False,
        description="NeMo RL's REINFORCE++ option: the KL penalty "
        "(reference_policy_kl_penalty * the reference_policy_kl_type estimate on prev_logprobs "
        "vs the reference's) is subtracted from each token's reward before the advantages are "
        "whitened, and the loss has no KL term (needs grpo.adv_estimator.name "
        "reinforce_plus_plus).",
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
        description="Upper clip epsilon >= 0: the probability ratio is kept <= 1 + ratio_clip_max "
        "(> ratio_clip_min: DAPO's clip-higher).",
    )
    ratio_clip_c: float | None = Field(
        default=None,
        gt=1.0,
        description="Dual-clip bound c > 1 on the loss of negative-advantage tokens (-c * A; "
        "usually 3). None: off.",
    )
    disable_ppo_ratio: bool = Field(
        default=False,
        description="REINFORCE / RLOO surrogate -A * lp instead of the clipped ratio "
        "(ratio_clip_min / ratio_clip_max unused).",
    )
    use_cispo: bool = Field(
        default=False,
        description="CISPO (MiniMax-M1): surrogate -A * sg(clip(r)) * lp, the clipped ratio as a "
        "gradient-free weight. Needs token_level_loss and no dual clip, REINFORCE, forced "
        "on-policy ratio or GSPO.",
    )
    force_on_policy_ratio: bool = Field(
        default=False,
        description="Ratio exactly 1 with the gradient of lp (prev_logprobs := sg(lp), also in "
        "the mismatch weight and metrics); only right with one optimizer step per rollout.",
    )
    sequence_level_importance_ratios: bool = Field(
        default=False,
        description="GSPO: one ratio per sequence (exp of the mean token log-ratio) and one "
        "mismatch weight per sequence (exp of the summed prev - gen). Needs "
        "token_level_loss=false.",
    )
    token_level_loss: bool = Field(
        default=True,
        description="True: token-level loss (normalised by the global valid tokens); False: "
        "sequence-level (per-sequence means, normalised by the global valid sequences).",
    )
    use_on_policy_kl_approximation: bool = Field(
        default=False,
        description="Weight the per-token KL by exp(lp - gen) (with its gradient) so it "
        "estimates the KL of the current policy rather than of the sampling engine's.",
    )
    use_importance_sampling_correction: bool = Field(
        default=False,
        description="Multiply each token's surrogate by the mismatch weight exp(prev - gen) (no "
        "gradient), correcting for generation (vLLM) vs training logprobs; needed by async or "
        "off-policy GRPO.",
    )
    truncated_importance_sampling_type: TruncatedISType | None = Field(
        default=None,
        description="How the mismatch weight is bounded: 'tis' clamps it to [ratio_min or 0, "
        "ratio]; 'icepop' zeroes tokens outside [ratio_min, ratio]; 'seq-mask-tis' zeroes "
        "sequences whose geometric-mean weight is outside. Needs "
        "use_importance_sampling_correction and truncated_importance_sampling_ratio.",
    )
    truncated_importance_sampling_ratio: float | None = Field(
        default=None,
        gt=0.0,
        description="Upper bound of the mismatch weight for truncated_importance_sampling_type.",
    )
    truncated_importance_sampling_ratio_min: float | None = Field(
        default=None,
        ge=0.0,
        description="Lower bound of the mismatch weight (<= the upper bound); required by "
        "'icepop' and 'seq-mask-tis', 0 when null with 'tis'.",
    )
    positive_example_nll_weight: float = Field(
        default=0.0,
        ge=0.0,
        description="VAPO's mu: adds mu times the mean NLL of the micro-batch's tokens of "
        "samples with reward > 0 (needs data['rewards'] [B]). 0: off (VAPO suggests 0.1).",
    )

    @property
    def loss_kl_penalty(self) -> float:
        """Beta of the loss's KL term: ``reference_policy_kl_penalty``, or 0 with
        ``use_kl_in_reward`` (the penalty is then in the advantages)."""
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty

    @model_validator(mode="after")
    def _check(self) -> ClippedPGLossConfig:
        problems = _combination_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _combination_problems(c: ClippedPGLossConfig) -> list[str]:
    """The config's contradictory or incomplete key combinations, one message each."""
    problems = []
    if c.sequence_level_importance_ratios and c.token_level_loss:
        problems.append(
            "sequence_level_importance_ratios (GSPO) weighs whole sequences and needs "
            "token_level_loss=false"
        )
    if c.disable_ppo_ratio and c.force_on_policy_ratio:
        problems.append(
            "disable_ppo_ratio and force_on_policy_ratio both replace the ratio; set one to false"
        )
    if c.use_cispo:
        for key, bad in (
            ("disable_ppo_ratio", c.disable_ppo_ratio),
            ("force_on_policy_ratio", c.force_on_policy_ratio),
            ("sequence_level_importance_ratios", c.sequence_level_importance_ratios),
            ("ratio_clip_c", c.ratio_clip_c is not None),
            ("token_level_loss=false", not c.token_level_loss),
        ):
            if bad:
                problems.append(f"use_cispo cannot be combined with {key}; drop one of them")
    tis_type, high, low = (
        c.truncated_importance_sampling_type,
        c.truncated_importance_sampling_ratio,
        c.truncated_importance_sampling_ratio_min,
    )
    if tis_type is None:
        for key, value in (
            ("truncated_importance_sampling_ratio", high),
            ("truncated_importance_sampling_ratio_min", low),
        ):
            if value is not None:
                problems.append(
                    f"{key} is set but truncated_importance_sampling_type is null; set the type "
                    "('tis', 'icepop' or 'seq-mask-tis') or the bound to null"
                )
        return problems
    if not c.use_importance_sampling_correction:
        problems.append(
            f"truncated_importance_sampling_type={tis_type!r} bounds the importance-sampling "
            "weight, which is off; set use_importance_sampling_correction=true"
        )
    if high is None:
        problems.append(
            f"truncated_importance_sampling_type={tis_type!r} needs "
            "truncated_importance_sampling_ratio (the upper bound)"
        )
    if low is None and tis_type != "tis":
        problems.append(
            f"truncated_importance_sampling_type={tis_type!r} needs "
            "truncated_importance_sampling_ratio_min (the lower bound)"
        )
    if high is not None and low is not None and low > high:
        problems.append(
            f"truncated_importance_sampling_ratio_min={low} must be <= "
            f"truncated_importance_sampling_ratio={high}"
        )
    if tis_type == "seq-mask-tis" and c.sequence_level_importance_ratios:
        problems.append(
            "truncated_importance_sampling_type='seq-mask-tis' keeps token-level weights and "
            "cannot be combined with sequence_level_importance_ratios"
        )
    return problems


_OWNER = "ClippedPGLossFn"
_BS = "[batch, seq]"
_Mean = Callable[[torch.Tensor], torch.Tensor]  # [B, T] or [B] values -> micro-batch share of a global mean


@dataclass(frozen=True)
class _Batch:
    """The loss's data tensors, sliced to the logprobs' positions: ``[B, T]`` token fields."""

    mask: torch.Tensor  # token_mask * sample_mask, lp's dtype
    token_mask: torch.Tensor  # lp's dtype
    sample_mask: torch.Tensor  # [B], lp's dtype
    advantages: torch.Tensor
    generation_logprobs: torch.Tensor


def _token_field(data: Mapping[str, Any], key: str, full: tuple[int, int], start: int, floating: bool) -> torch.Tensor:
    """``data[key]`` checked against the data's ``[B, S]`` and cut to the logprobs' columns."""
    return data_tensor(data, key, full, _BS, floating=floating)[:, start:]


class ClippedPGLossFn:
    """Clipped policy-gradient loss with KL regularisation; see the module docstring.

    Input: ``next_token_logprobs`` ``[B, S]`` (ours) or ``[B, S - 1]`` (NeMo RL's). Data keys
    (``[B, S]`` unless noted): ``advantages``, ``generation_logprobs``, ``token_mask``,
    ``sample_mask`` ``[B]``; ``prev_logprobs`` unless ``force_on_policy_ratio``;
    ``reference_policy_logprobs`` when ``reference_policy_kl_penalty > 0``, and optionally
    ``curr_logprobs_unfiltered`` (shaped like ``next_token_logprobs``); ``rewards`` ``[B]`` when
    ``positive_example_nll_weight > 0``.

    Metrics (NeMo RL's names; additive over micro-batches except ``positive_nll_loss``, a
    micro-batch mean as in NeMo RL; token means divide by ``global_valid_toks``, sequence means
    by ``global_valid_seqs``): ``loss``; ``probs_ratio`` / ``probs_ratio_clamped`` (token mean
    of the ratio before / after clipping); ``kl_penalty`` (the KL term reduced like the loss,
    without beta); ``token_mult_prob_error`` (token mean of ``exp(|prev - gen|)``: 1 when
    trainer and engine agree); ``gen_kl_error`` / ``policy_kl_error`` (token mean of the
    ``reference_policy_kl_type`` estimate of KL(engine || trainer) / KL(trainer || engine));
    ``js_divergence_error`` (token mean of their Jensen-Shannon estimate);
    ``sampling_importance_ratio`` (mean mismatch weight after truncation, whether or not it is
    applied: token mean, or sequence mean with GSPO); ``is_oob_ratio`` (fraction of tokens, or
    of sequences for 'seq-mask-tis', whose weight fell outside the truncation bounds; 0 without
    truncation); ``positive_nll_loss`` (the VAPO NLL, 0 when off); ``num_valid_samples``;
    ``approx_entropy`` (token mean of ``-exp(lp - gen) * lp``). Ours besides: ``clip_fraction_low``
    / ``clip_fraction_high`` (tokens with the ratio below / above the clip range),
    ``dual_clip_fraction``, ``approx_kl`` (k3 estimate of KL(prev || current)),
    ``is_masked_fraction`` (tokens whose weight 'icepop' / 'seq-mask-tis' zeroed).
    """

    input_type = LossInputType.LOGPROB

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any]) -> None:
        """``cfg``: the config model, or a mapping of its keys (NeMo RL's calling convention),
        validated into one; missing keys take the model's defaults."""
        self.cfg = as_config(cfg, ClippedPGLossConfig, owner=_OWNER)
        self.loss_type = (
            LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        )

    def _batch(self, data: Mapping[str, Any], lp: torch.Tensor) -> tuple[_Batch, tuple[int, int], int]:
        """The data aligned with ``lp``: ``(batch, data's [B, S], first data column)``."""
        raw_mask = data.get("token_mask")
        has_mask = isinstance(raw_mask, torch.Tensor) and raw_mask.dim() == 2
        full = (lp.shape[0], int(raw_mask.shape[1]) if has_mask else lp.shape[1])
        start = full[1] - lp.shape[1]
        if start not in (0, 1):
            raise ValueError(
                f"'next_token_logprobs' {list(lp.shape)} must be [batch, seq] (zero first column) "
                f"or NeMo RL's [batch, seq - 1] (aligned with data[:, 1:]) for the data's "
                f"token_mask [batch, seq]={list(raw_mask.shape)}"
            )
        dtype = lp.dtype
        tmask = _token_field(data, "token_mask", full, start, floating=False).to(dtype)
        smask = sample_mask(data, full[0], dtype)
        batch = _Batch(
            mask=tmask * smask[:, None],
            token_mask=tmask,
            sample_mask=smask,
            advantages=_token_field(data, "advantages", full, start, floating=True).to(dtype),
            generation_logprobs=_token_field(data, "generation_logprobs", full, start, floating=True).to(dtype),
        )
        return batch, full, start

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global loss and its metrics (see the class docstring)."""
        c = self.cfg
        lp = logprob_input(kwargs, _OWNER)
        seqs = global_count(global_valid_seqs, "global_valid_seqs")
        toks = global_count(global_valid_toks, "global_valid_toks")
        b, full, start = self._batch(data, lp)
        mask, gen, adv = b.mask, b.generation_logprobs, b.advantages
        if c.force_on_policy_ratio:
            prev = lp.detach()
        else:
            prev = _token_field(data, "prev_logprobs", full, start, floating=True).to(lp.dtype)

        def token_mean(values: torch.Tensor) -> torch.Tensor:
            return global_token_mean(values.to(lp.dtype), mask, toks)

        def seq_mean(values: torch.Tensor) -> torch.Tensor:
            return safe_divide(masked_sum(values.to(lp.dtype), b.sample_mask), seqs)

        # Surrogate.
        ratio, ratio_clamped = self._ratios(lp, prev, b.token_mask)
        if c.use_cispo:
            pg = -adv * ratio_clamped.detach() * lp
        else:
            pg = torch.maximum(-adv * ratio, -adv * ratio_clamped)
        dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
        if c.ratio_clip_c is not None:
            bound = -c.ratio_clip_c * adv
            dual_clipped = (adv < 0) & (pg > bound)
            pg = torch.where(dual_clipped, bound, pg)

        # Engine/trainer mismatch weights (no gradient: prev and gen are data or detached).
        weight, oob_ratio, dropped = self._mismatch_weights(prev, gen, b, token_mean, seq_mean)
        applied = weight if c.use_importance_sampling_correction else torch.ones_like(weight)

        # One reduction of surrogate + beta * KL (the KL's reduction is the same as the surrogate's).
        kl = self._kl_per_token(data, lp, gen, full, start)
        per_token = applied * pg + c.loss_kl_penalty * kl
        nll = self._positive_nll(data, lp, mask)
        loss = aggregate(per_token, mask, self.loss_type, seqs, toks) + c.positive_example_nll_weight * nll

        with torch.no_grad():
            no_clip = torch.zeros_like(mask, dtype=torch.bool)
            lp_now = lp.detach()
            # Token means, reduced together; then every metric crosses to the host at once.
            token_terms = {
                "probs_ratio": ratio.detach(),
                "probs_ratio_clamped": ratio_clamped.detach(),
                "clip_fraction_low": no_clip if c.disable_ppo_ratio else ratio < 1.0 - c.ratio_clip_min,
                "clip_fraction_high": no_clip if c.disable_ppo_ratio else ratio > 1.0 + c.ratio_clip_max,
                "dual_clip_fraction": dual_clipped,
                "approx_kl": kl_estimate(prev, lp_now, "k3"),
                "approx_entropy": -torch.exp(lp_now - gen) * lp_now,
                "token_mult_prob_error": torch.exp((prev - gen).abs()),
                "gen_kl_error": kl_estimate(gen, prev, c.reference_policy_kl_type),
                "policy_kl_error": kl_estimate(prev, gen, c.reference_policy_kl_type),
                "js_divergence_error": js_divergence_estimate(prev, gen),
                "is_masked_fraction": dropped,
            }
            scalars = {
                "loss": loss.detach(),
                "kl_penalty": aggregate(kl.detach(), mask, self.loss_type, seqs, toks),
                "sampling_importance_ratio": (
                    seq_mean(weight[:, 0])
                    if c.sequence_level_importance_ratios
                    else token_mean(weight)
                ),
                "is_oob_ratio": oob_ratio,
                "positive_nll_loss": nll.detach(),
                "num_valid_samples": b.sample_mask.sum(),
            }
            means = global_token_means(list(token_terms.values()), mask, toks.to(lp.dtype))
            values = torch.cat(
                [means, torch.stack([v.to(lp.dtype).reshape(()) for v in scalars.values()])]
            ).tolist()
            metrics: dict[str, Any] = dict(zip([*token_terms, *scalars], values))
        return loss, metrics

    def _ratios(self, lp: torch.Tensor, prev: torch.Tensor, token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ratio, clipped ratio)`` ``[B, T]``; REINFORCE returns ``(lp, lp)``."""
        c = self.cfg
        if c.force_on_policy_ratio:
            ratio = torch.exp(lp - lp.detach())
            return ratio, ratio
        if c.disable_ppo_ratio:
            return lp, lp
        log_ratio = lp - prev
        if c.sequence_level_importance_ratios:
            log_ratio = per_sequence_mean(log_ratio, token_mask)[:, None].expand_as(lp)
        ratio = torch.exp(log_ratio)
        return ratio, ratio.clamp(1.0 - c.ratio_clip_min, 1.0 + c.ratio_clip_max)

    def _mismatch_weights(
        self, prev: torch.Tensor, gen: torch.Tensor, b: _Batch, token_mean: _Mean, seq_mean: _Mean
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(weight, is_oob_ratio, dropped)``: the truncated mismatch weight (``[B, T]``, or
        ``[B, 1]`` with GSPO), the fraction outside the bounds, and the ``[B, T]`` indicator of
        the tokens 'icepop' / 'seq-mask-tis' zeroed."""
        c = self.cfg
        if c.sequence_level_importance_ratios:
            weight = torch.exp(masked_sum(prev.detach() - gen, b.mask, dim=-1))[:, None]
        else:
            weight = torch.exp(prev.detach() - gen)
        weight = torch.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0)
        zero = torch.zeros((), dtype=prev.dtype)
        dropped = torch.zeros_like(b.mask)
        high, low = c.truncated_importance_sampling_ratio, c.truncated_importance_sampling_ratio_min
        kind = c.truncated_importance_sampling_type
        if kind == "tis":
            low = 0.0 if low is None else low
            outside = ((weight > high) | (weight < low)).expand_as(b.mask)
            return weight.clamp(low, high), token_mean(outside), dropped
        if kind == "icepop":
            keep = (weight >= low) & (weight <= high)
            dropped = (~keep).expand_as(b.mask).to(b.mask.dtype)
            return torch.where(keep, weight, zero), token_mean(dropped), dropped
        if kind == "seq-mask-tis":
            log_mismatch = torch.nan_to_num(prev.detach() - gen, nan=0.0, posinf=0.0, neginf=0.0)
            geo_mean = torch.exp(per_sequence_mean(log_mismatch, b.token_mask))
            keep = ((geo_mean >= low) & (geo_mean <= high)).to(prev.dtype)
            dropped = (1.0 - keep)[:, None].expand_as(b.mask)
            return weight * keep[:, None], seq_mean(1.0 - keep), dropped
        return weight, zero, dropped

    def _kl_per_token(
        self, data: Mapping[str, Any], lp: torch.Tensor, gen: torch.Tensor, full: tuple[int, int], start: int
    ) -> torch.Tensor:
        """``[B, T]`` weighted, clamped KL estimate to the reference policy (without beta); 0
        when the loss's beta is 0 (no reference logprobs read)."""
        c = self.cfg
        if c.loss_kl_penalty == 0:
            return torch.zeros_like(lp)
        ref = _token_field(data, "reference_policy_logprobs", full, start, floating=True).to(lp.dtype)
        lp_u = lp
        if "curr_logprobs_unfiltered" in data:
            lp_u = check_tensor(
                data["curr_logprobs_unfiltered"], "curr_logprobs_unfiltered", tuple(lp.shape),
                "next_token_logprobs' shape", floating=True,
            ).to(lp.dtype)
        if c.use_on_policy_kl_approximation:
            weight = torch.exp(lp_u - gen)
        else:
            weight = torch.exp(lp_u - lp_u.detach())  # 1, carrying the score-function gradient
        weight = torch.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0)
        if c.kl_input_clamp_value is not None:
            clamped = (lp_u - ref).abs() > c.kl_input_clamp_value
            weight = torch.where(clamped, weight.detach(), weight)
        kl = weight * kl_estimate(lp_u, ref, c.reference_policy_kl_type, c.kl_input_clamp_value)
        if c.kl_output_clamp_value is not None:
            kl = kl.clamp(-c.kl_output_clamp_value, c.kl_output_clamp_value)
        return kl

    def _positive_nll(self, data: Mapping[str, Any], lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """VAPO's NLL: mean of ``-lp`` over this micro-batch's valid tokens of samples with
        ``rewards > 0`` (0 when there are none or the weight is 0)."""
        if self.cfg.positive_example_nll_weight == 0:
            return torch.zeros((), dtype=lp.dtype)
        if "rewards" not in data:
            raise ValueError(
                "data is missing key 'rewards' ([batch]) needed by positive_example_nll_weight > 0 "
                "(the GRPO step puts them in its training batch); pass them or set the weight to 0"
            )
        rewards = check_tensor(data["rewards"], "rewards", (lp.shape[0],), "[batch]", floating=False)
        positive = mask * (rewards > 0).to(lp.dtype)[:, None]
        return safe_divide(masked_sum(-lp, positive), positive.sum())
