"""DraftCrossEntropyLoss against a loop re-derivation, invariance, gradcheck and errors."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.loss import DraftCrossEntropyLoss, LossInputType


def make_batch(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "teacher_logits": torch.randn(6, 4, 5, generator=g, dtype=torch.float64) * 2,
        "student_logits": torch.randn(6, 4, 5, generator=g, dtype=torch.float64),
        "mask": torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 1], [0, 1, 0, 0]]),
    }
    return {"sample_mask": torch.tensor([1, 1, 1, 0, 1, 1])}, inputs


def counts(data, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return data["sample_mask"].sum(), (inputs["mask"] * data["sample_mask"][:, None]).sum()


def test_matches_reference() -> None:
    data, inputs = make_batch()
    loss, metrics = DraftCrossEntropyLoss()(data, *counts(data, inputs), **inputs)
    total, agree, n = 0.0, 0, 0
    for b in range(6):
        for t in range(4):
            if not (data["sample_mask"][b] and inputs["mask"][b, t]):
                continue
            n += 1
            teacher = inputs["teacher_logits"][b, t].tolist()
            student = inputs["student_logits"][b, t].tolist()
            z_t = sum(math.exp(x) for x in teacher)
            log_z_s = math.log(sum(math.exp(x) for x in student))
            total -= sum(math.exp(x) / z_t * (y - log_z_s) for x, y in zip(teacher, student))
            agree += int(max(range(5), key=teacher.__getitem__) == max(range(5), key=student.__getitem__))
    assert loss.item() == pytest.approx(total / n, rel=1e-12)
    assert metrics == pytest.approx({"loss": total / n, "top1_agreement": agree / n, "num_valid_tokens": float(n)})
    assert DraftCrossEntropyLoss.input_type is LossInputType.DRAFT


def test_microbatch_invariance(split_invariance) -> None:
    data, inputs = make_batch(1)
    split_invariance(DraftCrossEntropyLoss(), data, inputs, *counts(data, inputs))


def test_gradcheck_and_teacher_constant() -> None:
    data, inputs = make_batch(2)
    gseqs, gtoks = counts(data, inputs)
    teacher = inputs["teacher_logits"].clone().requires_grad_()
    f = lambda s: DraftCrossEntropyLoss()(data, gseqs, gtoks, teacher_logits=teacher, student_logits=s, mask=inputs["mask"])[0]  # noqa: E731
    student = inputs["student_logits"].clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (student,))
    f(student).backward()
    assert teacher.grad is None


def test_bad_inputs() -> None:
    data, inputs = make_batch()
    gseqs, gtoks = counts(data, inputs)
    with pytest.raises(ValueError, match=r"'teacher_logits' must have shape \[batch, seq, vocab\]=\[6, 4, 5\]"):
        DraftCrossEntropyLoss()(data, gseqs, gtoks, **{**inputs, "teacher_logits": inputs["teacher_logits"][..., :4]})
    with pytest.raises(ValueError, match=r"'mask' must have shape \[batch, seq\]=\[6, 4\]"):
        DraftCrossEntropyLoss()(data, gseqs, gtoks, **{**inputs, "mask": inputs["mask"][:, :3]})
    with pytest.raises(TypeError, match="mask"):
        DraftCrossEntropyLoss()(data, gseqs, gtoks, teacher_logits=inputs["teacher_logits"], student_logits=inputs["student_logits"])
