"""NLLLoss against a loop re-derivation, micro-batch invariance, gradcheck and errors."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.algorithms.loss import LossType, NLLLoss


def make_batch(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
    token_mask = torch.tensor(
        [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    )
    return {"token_mask": token_mask, "sample_mask": torch.tensor([1, 1, 1, 0, 1, 1])}, lp


def counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return data["sample_mask"].sum(), (data["token_mask"] * data["sample_mask"][:, None]).sum()


def test_matches_reference() -> None:
    data, lp = make_batch()
    gseqs, gtoks = counts(data)
    loss, metrics = NLLLoss()(data, gseqs, gtoks, next_token_logprobs=lp)
    total, n = 0.0, 0
    for b in range(6):
        for t in range(5):
            if data["sample_mask"][b] and data["token_mask"][b, t]:
                total -= float(lp[b, t])
                n += 1
    assert n == int(gtoks) == 9
    assert loss.item() == pytest.approx(total / n, rel=1e-14)
    assert metrics == {"loss": pytest.approx(total / n), "num_unmasked_tokens": 9.0, "num_valid_samples": 5.0}
    assert NLLLoss.loss_type is LossType.TOKEN_LEVEL


def test_microbatch_invariance(split_invariance) -> None:
    data, lp = make_batch(1)
    split_invariance(NLLLoss(), data, {"next_token_logprobs": lp}, *counts(data))


def test_gradcheck() -> None:
    data, lp = make_batch(2)
    gseqs, gtoks = counts(data)
    assert torch.autograd.gradcheck(lambda x: NLLLoss()(data, gseqs, gtoks, next_token_logprobs=x)[0], (lp.requires_grad_(),))


def test_bad_inputs() -> None:
    data, lp = make_batch()
    gseqs, gtoks = counts(data)
    with pytest.raises(ValueError, match=r"data is missing key 'token_mask' \(expected shape \[batch, seq\]=\[6, 5\]\)"):
        NLLLoss()({"sample_mask": data["sample_mask"]}, gseqs, gtoks, next_token_logprobs=lp)
    with pytest.raises(ValueError, match="floating-point"):
        NLLLoss()(data, gseqs, gtoks, next_token_logprobs=data["token_mask"])
    with pytest.raises(ValueError, match=r"'token_mask' must have shape \[batch, seq\]=\[6, 5\]"):
        NLLLoss()({**data, "token_mask": data["token_mask"].T}, gseqs, gtoks, next_token_logprobs=lp)
