"""ClippedPGLossFn against a token-by-token float64 re-derivation of NeMo RL's semantics (loss
and gradient), closed-form gradients per key, both logprob conventions, invariants and errors."""

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
SEQ = {"token_level_loss": False}
IS = {"use_importance_sampling_correction": True}

# One variant per key (and the combinations NeMo RL allows that change the arithmetic).
VARIANTS = {
    "plain": {},
    "sequence_level": SEQ,
    "dual_clip": {"ratio_clip_c": 1.5},
    "k1_input_clamp": {"reference_policy_kl_type": "k1", "kl_input_clamp_value": 0.3},
    "k3_input_clamp": {"kl_input_clamp_value": 0.3},
    "k3_output_clamp": {"kl_output_clamp_value": 0.02},
    "k2_on_policy_kl": {"reference_policy_kl_type": "k2", "use_on_policy_kl_approximation": True},
    "on_policy_kl_clamped": {"use_on_policy_kl_approximation": True, "kl_input_clamp_value": 0.3},
    "no_kl": {"reference_policy_kl_penalty": 0.0},
    "is_correction": IS,
    "tis": {**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.1},
    "tis_min": {
        **IS,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.1,
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "icepop": {
        **IS,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.25,
        "truncated_importance_sampling_ratio_min": 0.8,
    },
    "seq_mask_tis": {
        **IS,
        **SEQ,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.03,
        "truncated_importance_sampling_ratio_min": 0.97,
    },
    "gspo": {"sequence_level_importance_ratios": True, **SEQ},
    "gspo_is": {"sequence_level_importance_ratios": True, **SEQ, **IS, "ratio_clip_c": 2.0},
    "gspo_tis": {
        "sequence_level_importance_ratios": True,
        **SEQ,
        **IS,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.05,
    },
    "reinforce": {"disable_ppo_ratio": True},
    "reinforce_dual_clip": {"disable_ppo_ratio": True, "ratio_clip_c": 3.0, **IS},
    "cispo": {"use_cispo": True, "ratio_clip_max": 0.1},
    "force_on_policy": {"force_on_policy_ratio": True},
    "positive_nll": {"positive_example_nll_weight": 0.1},
    "unfiltered_kl": {"use_on_policy_kl_approximation": True},  # with curr_logprobs_unfiltered
}
NOT_ADDITIVE = {"positive_nll"}  # NeMo RL's VAPO term is a micro-batch mean


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
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64),
    }
    # Garbage outside the mask must not matter.
    outside = token_mask == 0
    for key in ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        data[key] = torch.where(outside, torch.full_like(lp, -7.5), data[key])
    return data, torch.where(outside, torch.full_like(lp, -3.0), lp)


def inputs_for(variant: str, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(cfg, data, leaves)``: leaves are the differentiable inputs (``lp`` and, for
    'unfiltered_kl', ``curr_logprobs_unfiltered``), not yet in ``data``."""
    data, lp = make_batch(seed)
    leaves = {"lp": lp.clone().requires_grad_()}
    if variant == "unfiltered_kl":
        leaves["unfiltered"] = (lp + 0.2 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).requires_grad_()
    return {**BASE_CFG, **VARIANTS[variant]}, data, leaves


def with_leaves(data: dict, leaves: dict[str, torch.Tensor]) -> dict:
    return {**data, "curr_logprobs_unfiltered": leaves["unfiltered"]} if "unfiltered" in leaves else data


def global_counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    valid = data["token_mask"] * data["sample_mask"][:, None]
    return data["sample_mask"].sum(), valid.sum()


def reference_loss(cfg: dict, data: dict, leaves: dict[str, torch.Tensor], gseqs: float, gtoks: float) -> torch.Tensor:
    """NeMo RL's ClippedPGLossFn re-derived one token at a time on 0-d float64 tensors
    (differentiable: autograd of this reference is the reference gradient)."""
    c = {**ClippedPGLossConfig().model_dump(), **cfg}
    lp = leaves["lp"]
    lp_u = leaves.get("unfiltered", lp)
    lo, hi, dual, beta = c["ratio_clip_min"], c["ratio_clip_max"], c["ratio_clip_c"], c["reference_policy_kl_penalty"]
    tis, tis_hi, tis_lo = (
        c["truncated_importance_sampling_type"],
        c["truncated_importance_sampling_ratio"],
        c["truncated_importance_sampling_ratio_min"],
    )
    actor = kl_total = torch.zeros((), dtype=torch.float64)
    positive: list[torch.Tensor] = []
    for b in range(lp.shape[0]):
        tokens = [t for t in range(lp.shape[1]) if data["token_mask"][b, t]]
        if not data["sample_mask"][b] or not tokens:
            continue
        n = len(tokens)
        cur = {t: lp[b, t] for t in tokens}
        prev = {t: cur[t].detach() if c["force_on_policy_ratio"] else float(data["prev_logprobs"][b, t]) for t in tokens}
        gen = {t: float(data["generation_logprobs"][b, t]) for t in tokens}
        seq_log_ratio = sum(cur[t] - prev[t] for t in tokens) / n
        seq_mismatch_sum = float(sum(prev[t] - gen[t] for t in tokens))
        seq_geo_mean = math.exp(seq_mismatch_sum / n)
        a_sum = k_sum = torch.zeros((), dtype=torch.float64)
        for t in tokens:
            adv = float(data["advantages"][b, t])
            if c["force_on_policy_ratio"]:
                r = r_clip = torch.exp(cur[t] - cur[t].detach())
            elif c["disable_ppo_ratio"]:
                r = r_clip = cur[t]
            else:
                r = torch.exp(seq_log_ratio if c["sequence_level_importance_ratios"] else cur[t] - prev[t])
                r_clip = r.clamp(1 - lo, 1 + hi)
            pg = -adv * r_clip.detach() * cur[t] if c["use_cispo"] else max(-adv * r, -adv * r_clip)
            if dual is not None and adv < 0:
                pg = min(pg, torch.tensor(-dual * adv, dtype=torch.float64))
            w = math.exp(seq_mismatch_sum) if c["sequence_level_importance_ratios"] else math.exp(float(prev[t] - gen[t]))
            if tis == "tis":
                w = min(max(w, tis_lo or 0.0), tis_hi)
            elif tis == "icepop":
                w = w if tis_lo <= w <= tis_hi else 0.0
            elif tis == "seq-mask-tis":
                w = w if tis_lo <= seq_geo_mean <= tis_hi else 0.0
            a_sum = a_sum + (w if c["use_importance_sampling_correction"] else 1.0) * pg
            if beta:
                u = lp_u[b, t]
                v = torch.exp(u - gen[t]) if c["use_on_policy_kl_approximation"] else torch.exp(u - u.detach())
                d = u - float(data["reference_policy_logprobs"][b, t])
                bound = c["kl_input_clamp_value"]
                if bound is not None and abs(float(d.detach())) > bound:
                    d, v = torch.tensor(math.copysign(bound, float(d.detach())), dtype=torch.float64), v.detach()
                k = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) - 1 + d}[c["reference_policy_kl_type"]]
                kl = v * k
                if c["kl_output_clamp_value"] is not None:
                    kl = kl.clamp(-c["kl_output_clamp_value"], c["kl_output_clamp_value"])
                k_sum = k_sum + kl
            if float(data["rewards"][b]) > 0:
                positive.append(-cur[t])
        scale = 1.0 if c["token_level_loss"] else 1.0 / n
        actor, kl_total = actor + scale * a_sum, kl_total + scale * k_sum
    norm = gtoks if c["token_level_loss"] else gseqs
    nll = sum(positive) / len(positive) if positive and c["positive_example_nll_weight"] else 0.0
    return actor / norm + beta * kl_total / norm + c["positive_example_nll_weight"] * nll


def run_loss(cfg: dict, data: dict, leaves: dict[str, torch.Tensor], shift: bool = False) -> tuple[torch.Tensor, dict, dict]:
    """Our loss, its metrics and the gradients of the leaves; ``shift``: NeMo RL's [B, S-1] input."""
    gseqs, gtoks = global_counts(data)
    lp = leaves["lp"][:, 1:] if shift else leaves["lp"]
    loss, metrics = ClippedPGLossFn(cfg)(with_leaves(data, leaves), gseqs, gtoks, next_token_logprobs=lp)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return loss.detach(), metrics, {k: (g if g is not None else torch.zeros_like(v)) for (k, v), g in zip(leaves.items(), grads)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loss_and_gradient_match_reference(variant: str) -> None:
    cfg, data, leaves = inputs_for(variant)
    gseqs, gtoks = global_counts(data)
    loss, metrics, grads = run_loss(cfg, data, leaves)
    expected = reference_loss(cfg, data, leaves, float(gseqs), float(gtoks))
    expected_grads = torch.autograd.grad(expected, list(leaves.values()), allow_unused=True)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-14)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-12, abs=1e-14)
    for (name, grad), want in zip(grads.items(), expected_grads):
        want = torch.zeros_like(grad) if want is None else want
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-13, msg=f"gradient of {name}")
    assert ClippedPGLossFn(cfg).loss_type is (LossType.TOKEN_LEVEL if cfg["token_level_loss"] else LossType.SEQUENCE_LEVEL)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_nemo_rl_logprob_convention_gives_the_same_loss(variant: str) -> None:
    """[B, S-1] aligned with data[:, 1:] (NeMo RL) vs [B, S] with position 0 (ours): same loss,
    same gradient on the shared positions, none on position 0."""
    cfg, data, leaves = inputs_for(variant)
    ours = run_loss(cfg, data, leaves)
    shifted_leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    if "unfiltered" in shifted_leaves:  # a model output: shaped like next_token_logprobs
        full = shifted_leaves.pop("unfiltered")
        cut = full[:, 1:].detach().clone().requires_grad_()
        shifted_leaves["unfiltered"] = cut
    nemo = run_loss(cfg, data, shifted_leaves, shift=True)
    assert nemo[0].item() == pytest.approx(ours[0].item(), rel=1e-13, abs=1e-15)
    assert nemo[1] == pytest.approx(ours[1], rel=1e-12, abs=1e-14)
    torch.testing.assert_close(nemo[2]["lp"][:, 0], torch.zeros(6, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(nemo[2]["lp"][:, 1:], ours[2]["lp"][:, 1:], rtol=1e-12, atol=1e-15)
    if "unfiltered" in leaves:
        torch.testing.assert_close(nemo[2]["unfiltered"], ours[2]["unfiltered"][:, 1:], rtol=1e-12, atol=1e-15)


def test_every_variant_changes_the_loss_or_gradient() -> None:
    """Each key changes the arithmetic on the test batch (so the reference tests can fail)."""
    base = {name: run_loss(*inputs_for(name)) for name in ("plain", "sequence_level", "is_correction")}
    for name in sorted(set(VARIANTS) - set(base)):
        cfg = VARIANTS[name]
        against = "sequence_level" if not cfg.get("token_level_loss", True) else "plain"
        if name in ("tis", "tis_min", "icepop"):
            against = "is_correction"
        loss, _, grads = run_loss(*inputs_for(name))
        other_loss, _, other_grads = base[against]
        same = loss.item() == pytest.approx(other_loss.item(), rel=1e-9) and torch.allclose(grads["lp"], other_grads["lp"], rtol=1e-9, atol=0)
        assert not same, (name, against)
    for name in ("k1_input_clamp", "k3_input_clamp", "k3_output_clamp", "on_policy_kl_clamped"):  # the clamps bite
        cfg, data, leaves = inputs_for(name)
        unclamped = {k: v for k, v in cfg.items() if not k.endswith("clamp_value")}
        assert run_loss(cfg, data, leaves)[0].item() != pytest.approx(run_loss(unclamped, data, leaves)[0].item(), rel=1e-9), name
    for name in ("tis", "tis_min", "icepop", "seq_mask_tis", "gspo_tis"):
        assert 0 < run_loss(*inputs_for(name))[1]["is_oob_ratio"] < 1, name


def valid_tokens(data: dict) -> list[tuple[int, int]]:
    return [(b, t) for b in range(6) for t in range(7) if data["token_mask"][b, t] and data["sample_mask"][b]]


def test_metrics_match_hand_values() -> None:
    cfg = {**BASE_CFG, "reference_policy_kl_type": "k2"}
    data, lp = make_batch(seed=3)
    gseqs, gtoks = global_counts(data)
    _, metrics = ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=lp)
    valid = valid_tokens(data)
    prev, gen, ref = data["prev_logprobs"], data["generation_logprobs"], data["reference_policy_logprobs"]

    def mean(fn) -> float:
        return sum(fn(b, t) for b, t in valid) / len(valid)

    ratio = lambda b, t: math.exp(float(lp[b, t] - prev[b, t]))  # noqa: E731
    p = lambda b, t: float(prev[b, t])  # noqa: E731
    q = lambda b, t: float(gen[b, t])  # noqa: E731
    assert metrics["probs_ratio"] == pytest.approx(mean(ratio))
    assert metrics["probs_ratio_clamped"] == pytest.approx(mean(lambda b, t: min(max(ratio(b, t), 0.8), 1.28)))
    assert metrics["clip_fraction_low"] == pytest.approx(mean(lambda b, t: float(ratio(b, t) < 0.8)))
    assert metrics["clip_fraction_high"] == pytest.approx(mean(lambda b, t: float(ratio(b, t) > 1.28)))
    assert metrics["token_mult_prob_error"] == pytest.approx(mean(lambda b, t: math.exp(abs(p(b, t) - q(b, t)))))
    # estimators follow reference_policy_kl_type (k2 here): KL(engine || trainer), KL(trainer || engine)
    assert metrics["gen_kl_error"] == pytest.approx(mean(lambda b, t: (q(b, t) - p(b, t)) ** 2 / 2))
    assert metrics["policy_kl_error"] == pytest.approx(mean(lambda b, t: (p(b, t) - q(b, t)) ** 2 / 2))

    def js(b: int, t: int) -> float:
        m = math.log(0.5 * math.exp(p(b, t)) + 0.5 * math.exp(q(b, t)))
        f = lambda x: math.exp(x) - x - 1  # noqa: E731
        return 0.5 * f(p(b, t) - m) + 0.5 * f(q(b, t) - m)

    assert metrics["js_divergence_error"] == pytest.approx(mean(js))
    assert metrics["js_divergence_error"] > 0
    # reported whether or not the correction is applied
    assert metrics["sampling_importance_ratio"] == pytest.approx(mean(lambda b, t: math.exp(p(b, t) - q(b, t))))
    assert metrics["kl_penalty"] == pytest.approx(mean(lambda b, t: float(lp[b, t] - ref[b, t]) ** 2 / 2))  # no beta
    assert metrics["approx_entropy"] == pytest.approx(mean(lambda b, t: -math.exp(float(lp[b, t]) - q(b, t)) * float(lp[b, t])))
    assert metrics["is_oob_ratio"] == 0.0 and metrics["positive_nll_loss"] == 0.0
    assert metrics["num_valid_samples"] == 5


def test_truncation_metrics_match_hand_values() -> None:
    data, lp = make_batch(seed=3)
    gseqs, gtoks = global_counts(data)
    valid = valid_tokens(data)
    w = {(b, t): math.exp(float(data["prev_logprobs"][b, t] - data["generation_logprobs"][b, t])) for b, t in valid}
    run = lambda name: ClippedPGLossFn({**BASE_CFG, **VARIANTS[name]})(data, gseqs, gtoks, next_token_logprobs=lp)[1]  # noqa: E731
    tis = run("tis_min")
    assert tis["is_oob_ratio"] == pytest.approx(sum(not 0.9 <= x <= 1.1 for x in w.values()) / len(valid))
    assert tis["sampling_importance_ratio"] == pytest.approx(sum(min(max(x, 0.9), 1.1) for x in w.values()) / len(valid))
    icepop = run("icepop")
    outside = sum(not 0.8 <= x <= 1.25 for x in w.values()) / len(valid)
    assert icepop["is_oob_ratio"] == pytest.approx(outside) and icepop["is_masked_fraction"] == pytest.approx(outside)
    seq = run("seq_mask_tis")
    rows = sorted({b for b, _ in valid})
    geo = {b: math.exp(sum(math.log(w[b, t]) for bb, t in valid if bb == b) / sum(bb == b for bb, _ in valid)) for b in rows}
    dropped = [b for b in rows if not 0.97 <= geo[b] <= 1.03]
    assert 0 < len(dropped) < len(rows)
    assert seq["is_oob_ratio"] == pytest.approx(len(dropped) / float(gseqs))  # per sequence
    gspo = run("gspo")  # one weight per sequence: exp(sum of prev - gen), averaged over sequences
    kept_rows = [b for b in range(6) if data["sample_mask"][b]]  # row 5 has no valid token: weight 1
    seq_w = [math.exp(sum(math.log(w[b, t]) for bb, t in valid if bb == b)) for b in kept_rows]
    assert gspo["sampling_importance_ratio"] == pytest.approx(sum(seq_w) / float(gseqs))


def test_positive_nll_metric_and_gradient() -> None:
    """VAPO: mu * mean(-lp) over valid tokens of samples with reward > 0; gradient -mu / n there."""
    data, lp = make_batch(seed=8)
    gseqs, gtoks = global_counts(data)
    cfg = {**BASE_CFG, "reference_policy_kl_penalty": 0.0, "positive_example_nll_weight": 0.3}
    data["advantages"] = torch.zeros_like(data["advantages"])
    leaf = lp.clone().requires_grad_()
    loss, metrics = ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=leaf)
    loss.backward()
    positive = [(b, t) for b, t in valid_tokens(data) if data["rewards"][b] > 0]
    assert metrics["positive_nll_loss"] == pytest.approx(-sum(float(lp[b, t]) for b, t in positive) / len(positive))
    expected = torch.zeros_like(lp)
    for b, t in positive:
        expected[b, t] = -0.3 / len(positive)
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="'rewards'.*positive_example_nll_weight"):
        ClippedPGLossFn(cfg)({k: v for k, v in data.items() if k != "rewards"}, gseqs, gtoks, next_token_logprobs=lp)


def test_closed_form_gradients() -> None:
    """Gradients derived on paper, per token of a valid sample, N = global valid tokens."""
    data, lp = make_batch(seed=5)
    gseqs, gtoks = global_counts(data)
    n = float(gtoks)
    valid = (data["token_mask"] * data["sample_mask"][:, None]).to(torch.float64)
    adv, prev, ref = data["advantages"], data["prev_logprobs"], data["reference_policy_logprobs"]
    no_kl = {**BASE_CFG, "reference_policy_kl_penalty": 0.0}

    def grad(cfg: dict, batch: dict = data) -> torch.Tensor:
        leaf = lp.clone().requires_grad_()
        ClippedPGLossFn(cfg)(batch, gseqs, gtoks, next_token_logprobs=leaf)[0].backward()
        return leaf.grad

    # REINFORCE: loss -A * lp
    torch.testing.assert_close(grad({**no_kl, "disable_ppo_ratio": True}), -adv * valid / n)
    # CISPO: loss -A * sg(clip(r)) * lp
    r_clip = torch.exp(lp - prev).clamp(0.8, 1.28)
    torch.testing.assert_close(grad({**no_kl, "use_cispo": True}), -adv * r_clip * valid / n)
    # KL alone (A = 0), k3 with d = lp - ref: value exp(-d) - 1 + d, pathwise 1 - exp(-d), and the
    # score-function term k3 * 1 from the sampling weight exp(lp - sg(lp))
    zero_adv = {**data, "advantages": torch.zeros_like(adv)}
    d = lp - ref
    k3 = torch.exp(-d) - 1 + d
    torch.testing.assert_close(grad(BASE_CFG, zero_adv), 0.05 * (k3 + 1 - torch.exp(-d)) * valid / n)
    # GSPO, sequence-level loss, ratios inside the clip range: d(-A_b r_b)/d lp_t = -A_b r_b / n_b
    gspo = {**no_kl, **VARIANTS["gspo"], "ratio_clip_min": 0.99, "ratio_clip_max": 100.0}
    counts = valid.sum(-1, keepdim=True).clamp_min(1)
    seq_r = torch.exp(((lp - prev) * valid).sum(-1, keepdim=True) / counts)
    per_seq_adv = (adv * valid).sum(-1, keepdim=True) / counts  # loss: mean over tokens of -A_t r_b
    torch.testing.assert_close(grad(gspo), -per_seq_adv * seq_r * valid / counts / float(gseqs))


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - NOT_ADDITIVE))
def test_microbatch_invariance(variant: str, split_invariance) -> None:
    cfg, data, leaves = inputs_for(variant, seed=1)
    gseqs, gtoks = global_counts(data)
    inputs = {"next_token_logprobs": leaves["lp"]}
    if "unfiltered" in leaves:
        inputs["curr_logprobs_unfiltered"] = leaves["unfiltered"]

    def loss_fn(micro_data, s, t, next_token_logprobs, **extra):
        return ClippedPGLossFn(cfg)({**micro_data, **extra}, s, t, next_token_logprobs=next_token_logprobs)

    split_invariance(loss_fn, data, inputs, gseqs, gtoks)


@pytest.mark.parametrize("variant", ["plain", "sequence_level", "dual_clip", "k2_on_policy_kl", "tis", "gspo", "reinforce"])
def test_gradcheck(variant: str) -> None:
    data, lp = make_batch(seed=2, batch=6, seq=7)
    gseqs, gtoks = global_counts(data)
    # (CISPO: its stop-gradient weight is invisible to finite differences; see the closed forms)
    # finite differences cannot see the KL's score-function term (its weight exp(lp - sg(lp)) is 1
    # at every point), so the KL is off unless its weight is a real function (on-policy KL)
    beta = BASE_CFG["reference_policy_kl_penalty"] if variant == "k2_on_policy_kl" else 0.0
    loss_fn = ClippedPGLossFn({**BASE_CFG, **VARIANTS[variant], "reference_policy_kl_penalty": beta})
    assert torch.autograd.gradcheck(
        lambda x: loss_fn(data, gseqs, gtoks, next_token_logprobs=x)[0], (lp.clone().requires_grad_(),)
    )


def test_on_policy_ratio_is_exactly_one() -> None:
    data, lp = make_batch(seed=4)
    data["prev_logprobs"] = lp.clone()
    data["generation_logprobs"] = lp.clone()
    gseqs, gtoks = global_counts(data)
    cfg = {**BASE_CFG, "use_importance_sampling_correction": True, "ratio_clip_c": 3.0}
    _, metrics = ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=lp)
    assert metrics["probs_ratio"] == 1.0
    assert metrics["probs_ratio_clamped"] == 1.0
    assert metrics["clip_fraction_low"] == 0.0 and metrics["clip_fraction_high"] == 0.0
    assert metrics["token_mult_prob_error"] == 1.0
    assert metrics["gen_kl_error"] == 0.0 and metrics["policy_kl_error"] == 0.0 and metrics["approx_kl"] == 0.0
    assert metrics["js_divergence_error"] == 0.0
    assert metrics["sampling_importance_ratio"] == 1.0
    # Gradient of the on-policy surrogate is -A * grad(lp) / N.
    leaf = lp.clone().requires_grad_()
    ClippedPGLossFn({**cfg, "reference_policy_kl_penalty": 0.0})(data, gseqs, gtoks, next_token_logprobs=leaf)[0].backward()
    valid = (data["token_mask"] * data["sample_mask"][:, None]).to(torch.float64)
    torch.testing.assert_close(leaf.grad, -data["advantages"] * valid / gtoks)


def test_force_on_policy_ratio_needs_no_prev_logprobs() -> None:
    """As in NeMo RL, prev := sg(lp) everywhere (surrogate, mismatch weight, metrics)."""
    data, lp = make_batch(seed=5)
    gseqs, gtoks = global_counts(data)
    cfg = {**BASE_CFG, "force_on_policy_ratio": True}
    without_prev = {k: v for k, v in data.items() if k != "prev_logprobs"}
    loss, metrics = ClippedPGLossFn(cfg)(without_prev, gseqs, gtoks, next_token_logprobs=lp)
    assert metrics["probs_ratio"] == 1.0 and metrics["clip_fraction_high"] == 0.0
    valid = valid_tokens(data)
    gap = [abs(float(lp[b, t] - data["generation_logprobs"][b, t])) for b, t in valid]
    assert metrics["token_mult_prob_error"] == pytest.approx(sum(math.exp(x) for x in gap) / len(valid))
    assert loss.item() == pytest.approx(ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=lp)[0].item(), rel=1e-15)


def test_kl_in_reward_leaves_the_loss_without_its_kl_term() -> None:
    """NeMo RL: with use_kl_in_reward the loss's beta is 0 (the step moved the KL into the
    advantages); no reference logprobs are read."""
    data, lp = make_batch(seed=6)
    gseqs, gtoks = global_counts(data)
    cfg = {**BASE_CFG, "reference_policy_kl_penalty": 0.5}
    without_ref = {k: v for k, v in data.items() if k != "reference_policy_logprobs"}
    in_reward, _ = ClippedPGLossFn({**cfg, "use_kl_in_reward": True})(without_ref, gseqs, gtoks, next_token_logprobs=lp)
    no_kl, _ = ClippedPGLossFn({**cfg, "reference_policy_kl_penalty": 0.0})(data, gseqs, gtoks, next_token_logprobs=lp)
    with_kl, _ = ClippedPGLossFn(cfg)(data, gseqs, gtoks, next_token_logprobs=lp)
    assert in_reward.item() == no_kl.item() != with_kl.item()


def test_token_mult_prob_error_sums_to_one_over_microbatches(microbatch_runner) -> None:
    data, lp = make_batch(seed=6)
    data["generation_logprobs"] = data["prev_logprobs"].clone()
    gseqs, gtoks = global_counts(data)
    _, _, metrics = microbatch_runner(ClippedPGLossFn(BASE_CFG), data, {"next_token_logprobs": lp}, (1, 2, 3), gseqs, gtoks)
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-14)


def test_empty_global_batch_gives_zero_not_nan() -> None:
    data, lp = make_batch()
    data["sample_mask"] = torch.zeros(6, dtype=torch.int64)
    for name in ("plain", "gspo_is", "seq_mask_tis", "positive_nll"):
        loss, metrics = ClippedPGLossFn({**BASE_CFG, **VARIANTS[name]})(data, torch.tensor(0), torch.tensor(0), next_token_logprobs=lp)
        assert loss.item() == 0.0 and metrics["probs_ratio"] == 0.0, name
        assert all(math.isfinite(v) for v in metrics.values()), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ratio_clip_min": 1.0}, "ratio_clip_min"),
        ({"ratio_clip_c": 0.5}, "ratio_clip_c"),
        ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
        ({"kl_input_clamp_value": 0.0}, "kl_input_clamp_value"),
        ({"kl_output_clamp_value": -1.0}, "kl_output_clamp_value"),
        ({"positive_example_nll_weight": -0.1}, "positive_example_nll_weight"),
        ({"sequence_level_importance_ratios": True}, "sequence_level_importance_ratios.*token_level_loss=false"),
        ({"disable_ppo_ratio": True, "force_on_policy_ratio": True}, "disable_ppo_ratio and force_on_policy_ratio"),
        ({"use_cispo": True, "disable_ppo_ratio": True}, "use_cispo.*disable_ppo_ratio"),
        ({"use_cispo": True, "force_on_policy_ratio": True}, "use_cispo.*force_on_policy_ratio"),
        ({"use_cispo": True, "ratio_clip_c": 3.0}, "use_cispo.*ratio_clip_c"),
        ({"use_cispo": True, "token_level_loss": False}, "use_cispo.*token_level_loss=false"),
        ({"use_cispo": True, "token_level_loss": False, "sequence_level_importance_ratios": True}, "use_cispo.*sequence_level_importance_ratios"),
        ({"truncated_importance_sampling_type": "clip"}, "truncated_importance_sampling_type"),
        ({"truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_ratio is set but truncated_importance_sampling_type is null"),
        ({"truncated_importance_sampling_ratio_min": 0.5}, "truncated_importance_sampling_ratio_min is set but"),
        ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}, "use_importance_sampling_correction=true"),
        ({**IS, "truncated_importance_sampling_type": "tis"}, "needs truncated_importance_sampling_ratio "),
        ({**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 2.0}, "icepop.*needs truncated_importance_sampling_ratio_min"),
        ({**IS, "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 2.0}, "seq-mask-tis.*needs truncated_importance_sampling_ratio_min"),
        ({**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.0, "truncated_importance_sampling_ratio_min": 1.5}, "ratio_min=1.5 must be <="),
        ({**IS, **VARIANTS["seq_mask_tis"], "sequence_level_importance_ratios": True}, "seq-mask-tis.*sequence_level_importance_ratios"),
        ({"truncated_importance_sampling_ratio_min": -0.5, **IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_ratio_min"),
        ({"ratio_clip": 0.2}, "unknown key"),
        ({"kl_clamp_value": 20.0}, "unknown key"),
    ],
)
def test_bad_config(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClippedPGLossFn({**BASE_CFG, **change})


def test_nemo_rl_recipe_section_loads_as_is() -> None:
    """The loss_fn section of NeMo RL's grpo_math_1B.yaml (every key it sets) validates."""
    section = {
        "reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k3", "kl_input_clamp_value": 20.0,
        "kl_output_clamp_value": 10.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None,
        "use_on_policy_kl_approximation": False, "use_importance_sampling_correction": False,
        "truncated_importance_sampling_type": None, "truncated_importance_sampling_ratio": None,
        "truncated_importance_sampling_ratio_min": None, "sequence_level_importance_ratios": False,
        "token_level_loss": True, "force_on_policy_ratio": False, "use_kl_in_reward": False, "use_cispo": False,
        "disable_ppo_ratio": False, "positive_example_nll_weight": 0.0,
    }
    assert ClippedPGLossFn(section).cfg.model_dump() == section


def test_missing_config_keys_take_the_model_defaults() -> None:
    """A mapping is validated into ClippedPGLossConfig: an omitted key means the model's default."""
    cfg = dict(BASE_CFG)
    del cfg["token_level_loss"], cfg["ratio_clip_c"]
    loss_fn = ClippedPGLossFn(cfg)
    assert loss_fn.cfg == ClippedPGLossConfig(**cfg)
    assert loss_fn.cfg.token_level_loss is ClippedPGLossConfig().token_level_loss is True
    _, data, leaves = inputs_for("plain", seed=3)
    gseqs, gtoks = global_counts(data)
    loss = loss_fn(data, gseqs, gtoks, next_token_logprobs=leaves["lp"])[0]
    assert loss.item() == pytest.approx(reference_loss(BASE_CFG, data, leaves, float(gseqs), float(gtoks)).item(), rel=1e-12)


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
    with pytest.raises(ValueError, match=r"NeMo RL's \[batch, seq - 1\].*\[6, 7\]"):
        loss_fn(data, gseqs, gtoks, next_token_logprobs=lp[:, 2:])
    with pytest.raises(ValueError, match="curr_logprobs_unfiltered"):
        loss_fn({**data, "curr_logprobs_unfiltered": lp}, gseqs, gtoks, next_token_logprobs=lp[:, 1:])
    with pytest.raises(ValueError, match="token_mask"):
        loss_fn({k: v for k, v in data.items() if k != "token_mask"}, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(TypeError, match="next_token_logprobs"):
        loss_fn(data, gseqs, gtoks, logits=lp)
    with pytest.raises(ValueError, match="global_valid_toks"):
        loss_fn(data, gseqs, torch.tensor([1, 2]), next_token_logprobs=lp)


def test_accepts_pydantic_config_and_batched_data_dict() -> None:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    _, data, leaves = inputs_for("plain", seed=7)
    gseqs, gtoks = global_counts(data)
    cfg = ClippedPGLossConfig(**BASE_CFG)
    loss_fn = ClippedPGLossFn(cfg)
    assert loss_fn.cfg is cfg
    loss, _ = loss_fn(BatchedDataDict(data), gseqs, gtoks, next_token_logprobs=leaves["lp"])
    assert loss.item() == pytest.approx(reference_loss(BASE_CFG, data, leaves, float(gseqs), float(gtoks)).item(), rel=1e-12)


def test_grpo_recipe_uses_the_loss_config_model() -> None:
    """One definition: the GRPO recipe's loss_fn section is the loss's own config model."""
    from nemo_rl.algorithms.grpo_config import GRPOMasterConfig

    assert GRPOMasterConfig.model_fields["loss_fn"].annotation is ClippedPGLossConfig
    assert GRPOMasterConfig().loss_fn == ClippedPGLossConfig()
