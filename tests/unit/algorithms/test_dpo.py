"""DPOLossFn against a loop re-derivation, micro-batch invariance, gradcheck and errors."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.loss import DPOLossFn, LossType

CFG = {
    "reference_policy_kl_penalty": 0.3,
    "preference_loss_weight": 1.0,
    "sft_loss_weight": 0.0,
    "preference_average_log_probs": False,
    "sft_average_log_probs": False,
}
VARIANTS = {
    "sum": {},
    "average": {"preference_average_log_probs": True},
    "sft_sum": {"sft_loss_weight": 0.7},
    "sft_average": {"sft_loss_weight": 0.7, "sft_average_log_probs": True, "preference_loss_weight": 0.5},
    "reference_free": {"reference_free": True},
}


def make_batch(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Six rows = three (chosen, rejected) pairs; the second pair is dropped by sample_mask."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(6, 6, generator=g, dtype=torch.float64) * 2
    token_mask = torch.zeros(6, 6, dtype=torch.int64)
    for b, (start, end) in enumerate([(2, 6), (2, 4), (1, 5), (1, 6), (3, 5), (3, 6)]):
        token_mask[b, start:end] = 1
    data = {
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1, 1, 0, 0, 1, 1]),
        "reference_policy_logprobs": -torch.rand(6, 6, generator=g, dtype=torch.float64) * 2,
    }
    return data, lp


def counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return data["sample_mask"].sum(), (data["token_mask"] * data["sample_mask"][:, None]).sum()


def reference(cfg: dict, data: dict[str, torch.Tensor], lp: torch.Tensor) -> dict[str, float]:
    full = {"reference_free": False, **cfg}
    beta = full["reference_policy_kl_penalty"]

    def score(values: torch.Tensor, b: int, average: bool) -> float:
        tokens = [float(values[b, t]) for t in range(values.shape[1]) if data["token_mask"][b, t]]
        return sum(tokens) / len(tokens) if average else sum(tokens)

    pref, sft, chosen_sum, rejected_sum, correct, pairs = 0.0, 0.0, 0.0, 0.0, 0.0, 0
    for pair in range(3):
        c, r = 2 * pair, 2 * pair + 1
        if not data["sample_mask"][c]:
            continue
        pairs += 1
        rewards = []
        for b in (c, r):
            s = score(lp, b, full["preference_average_log_probs"])
            if not full["reference_free"]:
                s -= score(data["reference_policy_logprobs"], b, full["preference_average_log_probs"])
            rewards.append(beta * s)
        margin = rewards[0] - rewards[1]
        pref += math.log1p(math.exp(-margin))
        sft -= score(lp, c, full["sft_average_log_probs"])
        chosen_sum += rewards[0]
        rejected_sum += rewards[1]
        correct += float(margin > 0)
    return {
        "loss": (full["preference_loss_weight"] * pref + full["sft_loss_weight"] * sft) / pairs,
        "preference_loss": pref / pairs,
        "sft_loss": sft / pairs,
        "rewards_chosen_mean": chosen_sum / pairs,
        "rewards_rejected_mean": rejected_sum / pairs,
        "accuracy": correct / pairs,
        "num_valid_samples": 2.0 * pairs,
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_reference(variant: str) -> None:
    cfg = {**CFG, **VARIANTS[variant]}
    data, lp = make_batch()
    loss, metrics = DPOLossFn(cfg)(data, *counts(data), next_token_logprobs=lp)
    expected = reference(cfg, data, lp)
    assert loss.item() == pytest.approx(expected["loss"], rel=1e-12)
    assert metrics == pytest.approx(expected, rel=1e-12)
    assert DPOLossFn.loss_type is LossType.SEQUENCE_LEVEL


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_microbatch_invariance(variant: str, split_invariance) -> None:
    data, lp = make_batch(1)
    split_invariance(
        DPOLossFn({**CFG, **VARIANTS[variant]}), data, {"next_token_logprobs": lp}, *counts(data),
        splits=((2, 2, 2), (4, 2), (2, 4)),
    )


@pytest.mark.parametrize("variant", ["sum", "sft_average"])
def test_gradcheck(variant: str) -> None:
    data, lp = make_batch(2)
    gseqs, gtoks = counts(data)
    loss_fn = DPOLossFn({**CFG, **VARIANTS[variant]})
    assert torch.autograd.gradcheck(lambda x: loss_fn(data, gseqs, gtoks, next_token_logprobs=x)[0], (lp.requires_grad_(),))


def test_bad_inputs() -> None:
    data, lp = make_batch()
    gseqs, gtoks = counts(data)
    loss_fn = DPOLossFn(CFG)
    with pytest.raises(ValueError, match="even batch"):
        loss_fn({k: v[:5] for k, v in data.items()}, gseqs, gtoks, next_token_logprobs=lp[:5])
    with pytest.raises(ValueError, match="sample_mask"):
        loss_fn({**data, "sample_mask": torch.tensor([1, 0, 1, 1, 1, 1])}, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(ValueError, match=r"reference_policy_logprobs.*\[batch, seq\]=\[6, 6\]"):
        loss_fn({k: v for k, v in data.items() if k != "reference_policy_logprobs"}, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(ValueError, match="reference_policy_kl_penalty"):
        DPOLossFn({**CFG, "reference_policy_kl_penalty": 0.0})
    with pytest.raises(ValueError, match="unknown key"):
        DPOLossFn({**CFG, "beta": 0.1})
