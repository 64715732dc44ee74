"""ClippedPGLossFn against a loop-by-loop float64 re-derivation, plus invariants and errors."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn, LossType

BASE_CFG = {
    "reference_policy_kl_penalty": 0.05,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "ratio_clip_c": None,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "token_level_loss": True,
}

VARIANTS = {
    "plain": {},
    "sequence_level": {"token_level_loss": False},
    "dual_clip": {"ratio_clip_c": 1.5},
    "k1": {"reference_policy_kl_type": "k1", "kl_clamp_value": 0.3},
    "k2_on_policy_kl": {"reference_policy_kl_type": "k2", "use_on_policy_kl_approximation": True},
    "no_kl": {"reference_policy_kl_penalty": 0.0},
    "is_correction": {"use_importance_sampling_correction": True},
    "tis_cap": {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.1},
    "token_mask": {"importance_sampling_token_mask_range": [0.8, 1.25]},
    "seq_mask": {"importance_sampling_seq_mask_range": [0.97, 1.03], "token_level_loss": False},
    "gspo": {"sequence_level_importance_ratios": True, "token_level_loss": False},
    "gspo_token": {"sequence_level_importance_ratios": True, "ratio_clip_c": 2.0},
}


def make_batch(seed: int = 0, batch: int = 6, seq: int = 7) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random batch with prompt tokens, padding, a dropped sample and a sample with no valid tokens."""
    g = torch.Generator().manual_seed(seed)

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(batch, seq, generator=g, dtype=torch.float64)

    lp = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 2 - 0.05
    token_mask = torch.zeros(batch, seq, dtype=torch.int64)
    for b, (start, end) in enumerate([(2, 7), (1, 5), (3, 6), (2, 4), (1, 7), (3, 3)]):
        token_mask[b, start:end] = 1
    prev = lp + noise(0.3)
    data = {
        "input_ids": torch.randint(0, 50, (batch, seq), generator=g),
        "advantages": noise(1.0),
        "prev_logprobs": prev,
        "generation_logprobs": prev + noise(0.15),
        "reference_policy_logprobs": lp + noise(0.4),
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.int64),
    }
    # Garbage outside the mask must not matter.
    outside = token_mask == 0
    for key in ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        data[key] = torch.where(outside, torch.full_like(lp, -7.5), data[key])
    return data, torch.where(outside, torch.full_like(lp, -3.0), lp)


def global_counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    valid = data["token_mask"] * data["sample_mask"][:, None]
    return data["sample_mask"].sum(), valid.sum()


def reference_loss(cfg: dict, data: dict[str, torch.Tensor], lp: torch.Tensor, gseqs: float, gtoks: float) -> float:
    """Plain-Python re-derivation of the loss, one token at a time."""
    full = {**BASE_CFG, "reference_policy_kl_type": "k3", "kl_clamp_value": None, **cfg}
    lo, hi, c, beta = full["ratio_clip_min"], full["ratio_clip_max"], full["ratio_clip_c"], full["reference_policy_kl_penalty"]
    total = 0.0
    for b in range(lp.shape[0]):
        if not data["sample_mask"][b]:
            continue
        tokens = [t for t in range(lp.shape[1]) if data["token_mask"][b, t]]
        cur = {t: float(lp[b, t]) for t in tokens}
        prev = {t: cur[t] if full.get("force_on_policy_ratio") else float(data["prev_logprobs"][b, t]) for t in tokens}
        gen = {t: float(data["generation_logprobs"][b, t]) for t in tokens}
        ref = {t: float(data["reference_policy_logprobs"][b, t]) for t in tokens}
        seq_log_ratio = sum(cur[t] - prev[t] for t in tokens) / max(len(tokens), 1)
        seq_mismatch = math.exp(sum(prev[t] - gen[t] for t in tokens) / max(len(tokens), 1))
        seq_sum = 0.0
        for t in tokens:
            adv = float(data["advantages"][b, t])
            r = math.exp(seq_log_ratio if full.get("sequence_level_importance_ratios") else cur[t] - prev[t])
            r_clip = min(max(r, 1 - lo), 1 + hi)
            pg = max(-adv * r, -adv * r_clip)
            if c is not None and adv < 0:
                pg = min(pg, c * abs(adv))
            d = cur[t] - ref[t]
            if full["kl_clamp_value"] is not None:
                d = max(-full["kl_clamp_value"], min(full["kl_clamp_value"], d))
            kl = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[full["reference_policy_kl_type"]]
            if full["use_on_policy_kl_approximation"]:
                kl *= math.exp(cur[t] - prev[t])
            mismatch = math.exp(prev[t] - gen[t])
            w = 1.0
            if full["use_importance_sampling_correction"]:
                w = mismatch
                if full.get("truncated_importance_sampling_ratio") is not None:
                    w = min(w, full["truncated_importance_sampling_ratio"])
            keep = True
            if full.get("importance_sampling_token_mask_range"):
                low, high = full["importance_sampling_token_mask_range"]
                keep = low <= mismatch <= high
            if full.get("importance_sampling_seq_mask_range"):
                low, high = full["importance_sampling_seq_mask_range"]
                keep = keep and low <= seq_mismatch <= high
            term = w * (pg + beta * kl) if keep else 0.0
            total += term if full["token_level_loss"] else 0.0
            seq_sum += term
        if not full["token_level_loss"] and tokens:
            total += seq_sum / len(tokens)
    return total / (gtoks if full["token_level_loss"] else gseqs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_reference(variant: str) -> None:
    cfg = {**BASE_CFG, **VARIANTS[variant]}
    data, lp = make_batch()
    gseqs, gtoks = global_counts(data)
    loss_fn = ClippedPGLossFn(cfg)
    loss, metrics = loss_fn(data, gseqs, gtoks, next_token_logprobs=lp)
    expected = reference_loss(cfg, data, lp, float(gseqs), float(gtoks))
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert loss_fn.loss_type is (LossType.TOKEN_LEVEL if cfg["token_level_loss"] else LossType.SEQUENCE_LEVEL)


def test_variants_are_exercised() -> None:
    """The masking/clipping variants actually change the loss on the test batch (tests can fail)."""
    data, lp = make_batch()
    gseqs, gtoks = global_counts(data)
    plain = ClippedPGLossFn(BASE_CFG)(data, gseqs, gtoks, next_token_logprobs=lp)[0]
    for name in ("dual_clip", "tis_cap", "token_mask", "gspo_token", "is_correction", "k1", "k2_on_policy_kl"):
        loss, metrics = ClippedPGLossFn({**BASE_CFG, **VARIANTS[name]})(data, gseqs, gtoks, next_token_logprobs=lp)
        assert loss.item() != pytest.approx(plain.item(), rel=1e-6), name
    _, metrics = ClippedPGLossFn({**BASE_CFG, **VARIANTS["token_mask"]})(data, gseqs, gtoks, next_token_logprobs=lp)
    assert 0 < metrics["is_masked_fraction"] < 1
    seq_plain = ClippedPGLossFn({**BASE_CFG, **VARIANTS["sequence_level"]})(data, gseqs, gtoks, next_token_logprobs=lp)[0]
    for name in ("seq_mask", "gspo"):
        loss = ClippedPGLossFn({**BASE_CFG, **VARIANTS[name]})(data, gseqs, gtoks, next_token_logprobs=lp)[0]
        assert loss.item() != pytest.approx(seq_plain.item(), rel=1e-6), name
    _, metrics = ClippedPGLossFn({**BASE_CFG, **VARIANTS["dual_clip"]})(data, gseqs, gtoks, next_token_logprobs=lp)
    assert metrics["dual_clip_fraction"] > 0


def test_metrics_match_reference() -> None:
    cfg = {**BASE_CFG, "use_importance_sampling_correction": True}
    data, lp = make_batch(seed=3)
    gseqs, gtoks = global_counts(data)
    _, metrics = ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=lp)
    valid = [(b, t) for b in range(6) for t in range(7) if data["token_mask"][b, t] and data["sample_mask"][b]]
    prev, gen, ref = data["prev_logprobs"], data["generation_logprobs"], data["reference_policy_logprobs"]

    def mean(fn) -> float:
        return sum(fn(b, t) for b, t in valid) / len(valid)

    ratio = lambda b, t: math.exp(float(lp[b, t] - prev[b, t]))  # noqa: E731
    assert metrics["probs_ratio"] == pytest.approx(mean(ratio))
    assert metrics["clip_fraction_low"] == pytest.approx(mean(lambda b, t: float(ratio(b, t) < 0.8)))
    assert metrics["clip_fraction_high"] == pytest.approx(mean(lambda b, t: float(ratio(b, t) > 1.28)))
    assert metrics["token_mult_prob_error"] == pytest.approx(mean(lambda b, t: math.exp(abs(float(prev[b, t] - gen[b, t])))))
    assert metrics["sampling_importance_ratio"] == pytest.approx(mean(lambda b, t: math.exp(float(prev[b, t] - gen[b, t]))))
    d = lambda b, t: float(gen[b, t] - prev[b, t])  # noqa: E731
    assert metrics["gen_kl_error"] == pytest.approx(mean(lambda b, t: math.exp(-d(b, t)) - 1 + d(b, t)))
    k = lambda b, t: float(lp[b, t] - ref[b, t])  # noqa: E731
    assert metrics["kl_penalty"] == pytest.approx(0.05 * mean(lambda b, t: math.exp(-k(b, t)) - 1 + k(b, t)))
    assert metrics["num_valid_samples"] == 5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_microbatch_invariance(variant: str, split_invariance) -> None:
    data, lp = make_batch(seed=1)
    gseqs, gtoks = global_counts(data)
    split_invariance(ClippedPGLossFn({**BASE_CFG, **VARIANTS[variant]}), data, {"next_token_logprobs": lp}, gseqs, gtoks)


@pytest.mark.parametrize("variant", ["plain", "sequence_level", "dual_clip", "k2_on_policy_kl", "tis_cap", "gspo"])
def test_gradcheck(variant: str) -> None:
    data, lp = make_batch(seed=2, batch=6, seq=7)
    gseqs, gtoks = global_counts(data)
    loss_fn = ClippedPGLossFn({**BASE_CFG, **VARIANTS[variant]})
    assert torch.autograd.gradcheck(
        lambda x: loss_fn(data, gseqs, gtoks, next_token_logprobs=x)[0], (lp.clone().requires_grad_(),)
    )


def test_on_policy_ratio_is_exactly_one() -> None:
    data, lp = make_batch(seed=4)
    data["prev_logprobs"] = lp.clone()
    data["generation_logprobs"] = lp.clone()
    gseqs, gtoks = global_counts(data)
    cfg = {**BASE_CFG, "use_importance_sampling_correction": True, "ratio_clip_c": 3.0}
    lp_leaf = lp.clone().requires_grad_()
    loss, metrics = ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=lp_leaf)
    assert metrics["probs_ratio"] == 1.0
    assert metrics["probs_ratio_clamped"] == 1.0
    assert metrics["clip_fraction_low"] == 0.0 and metrics["clip_fraction_high"] == 0.0
    assert metrics["token_mult_prob_error"] == 1.0
    assert metrics["gen_kl_error"] == 0.0 and metrics["approx_kl"] == 0.0
    assert metrics["sampling_importance_ratio"] == 1.0
    # Gradient of the on-policy surrogate is -A * grad(lp) / N (+ KL term).
    loss.backward()
    no_kl = ClippedPGLossFn({**cfg, "reference_policy_kl_penalty": 0.0})
    lp_leaf2 = lp.clone().requires_grad_()
    no_kl(data, gseqs, gtoks, next_token_logprobs=lp_leaf2)[0].backward()
    valid = (data["token_mask"] * data["sample_mask"][:, None]).to(torch.float64)
    torch.testing.assert_close(lp_leaf2.grad, -data["advantages"] * valid / gtoks)


def test_force_on_policy_ratio() -> None:
    data, lp = make_batch(seed=5)
    gseqs, gtoks = global_counts(data)
    cfg = {**BASE_CFG, "force_on_policy_ratio": True}
    loss, metrics = ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=lp)
    assert metrics["probs_ratio"] == 1.0 and metrics["clip_fraction_high"] == 0.0
    assert metrics["token_mult_prob_error"] > 1.0  # still measured against the data's prev_logprobs
    assert loss.item() == pytest.approx(reference_loss(cfg, data, lp, float(gseqs), float(gtoks)), rel=1e-12)


def test_token_mult_prob_error_sums_to_one_over_microbatches(microbatch_runner) -> None:
    data, lp = make_batch(seed=6)
    data["generation_logprobs"] = data["prev_logprobs"].clone()
    gseqs, gtoks = global_counts(data)
    _, _, metrics = microbatch_runner(ClippedPGLossFn(BASE_CFG), data, {"next_token_logprobs": lp}, (1, 2, 3), gseqs, gtoks)
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-14)


def test_empty_global_batch_gives_zero_not_nan() -> None:
    data, lp = make_batch()
    data["sample_mask"] = torch.zeros(6, dtype=torch.int64)
    loss, metrics = ClippedPGLossFn(BASE_CFG)(data, torch.tensor(0), torch.tensor(0), next_token_logprobs=lp)
    assert loss.item() == 0.0 and metrics["probs_ratio"] == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ratio_clip_min": 1.0}, "ratio_clip_min"),
        ({"ratio_clip_c": 0.5}, "ratio_clip_c"),
        ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
        ({"truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_ratio"),
        ({"importance_sampling_token_mask_range": [1.2, 0.8]}, "importance_sampling_token_mask_range"),
        ({"ratio_clip": 0.2}, "unknown key"),
    ],
)
def test_bad_config(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClippedPGLossFn({**BASE_CFG, **change})


def test_missing_config_keys_take_the_model_defaults() -> None:
    """A mapping is validated into ClippedPGLossConfig: an omitted key means the model's default."""
    data, lp = make_batch(seed=3)
    gseqs, gtoks = global_counts(data)
    cfg = dict(BASE_CFG)
    del cfg["token_level_loss"], cfg["ratio_clip_c"]
    loss_fn = ClippedPGLossFn(cfg)
    assert loss_fn.cfg == ClippedPGLossConfig(**cfg)
    assert loss_fn.cfg.token_level_loss is ClippedPGLossConfig().token_level_loss is True
    loss = loss_fn(data, gseqs, gtoks, next_token_logprobs=lp)[0]
    assert loss.item() == pytest.approx(reference_loss(BASE_CFG, data, lp, float(gseqs), float(gtoks)), rel=1e-12)


def test_bad_inputs() -> None:
    data, lp = make_batch()
    gseqs, gtoks = global_counts(data)
    loss_fn = ClippedPGLossFn(BASE_CFG)
    missing = {k: v for k, v in data.items() if k != "prev_logprobs"}
    with pytest.raises(ValueError, match=r"prev_logprobs.*\[batch, seq\]=\[6, 7\]"):
        loss_fn(missing, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(ValueError, match=r"'advantages' must have shape \[batch, seq\]=\[6, 7\], got \[6, 6\]"):
        loss_fn({**data, "advantages": data["advantages"][:, :6]}, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(ValueError, match="'generation_logprobs' must be a floating-point"):
        loss_fn({**data, "generation_logprobs": data["token_mask"]}, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(ValueError, match="sample_mask"):
        loss_fn({**data, "sample_mask": data["sample_mask"][:3]}, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(ValueError, match="next_token_logprobs"):
        loss_fn(data, gseqs, gtoks, next_token_logprobs=lp[0])
    with pytest.raises(TypeError, match="next_token_logprobs"):
        loss_fn(data, gseqs, gtoks, logits=lp)
    with pytest.raises(ValueError, match="global_valid_toks"):
        loss_fn(data, gseqs, torch.tensor([1, 2]), next_token_logprobs=lp)


def test_accepts_pydantic_config_and_batched_data_dict() -> None:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    data, lp = make_batch(seed=7)
    gseqs, gtoks = global_counts(data)
    cfg = ClippedPGLossConfig(**BASE_CFG)
    loss_fn = ClippedPGLossFn(cfg)
    assert loss_fn.cfg is cfg
    loss, _ = loss_fn(BatchedDataDict(data), gseqs, gtoks, next_token_logprobs=lp)
    assert loss.item() == pytest.approx(reference_loss(BASE_CFG, data, lp, float(gseqs), float(gtoks)), rel=1e-12)


def test_grpo_recipe_uses_the_loss_config_model() -> None:
    """One definition: the GRPO recipe's loss_fn section is the loss's own config model."""
    from nemo_rl.algorithms.grpo_config import GRPOMasterConfig

    assert GRPOMasterConfig.model_fields["loss_fn"].annotation is ClippedPGLossConfig
    assert GRPOMasterConfig().loss_fn == ClippedPGLossConfig()
