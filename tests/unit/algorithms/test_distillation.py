"""DistillationLossFn against a loop re-derivation from full distributions, invariance, errors."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.loss import DistillationLossFn, LossType

B, S, V, K = 6, 4, 9, 3


def make_batch(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Student/teacher full log-softmax [B, S, V] and the top-k inputs the loss takes."""
    g = torch.Generator().manual_seed(seed)
    student_full = torch.log_softmax(torch.randn(B, S, V, generator=g, dtype=torch.float64), -1)
    teacher_full = torch.log_softmax(2 * torch.randn(B, S, V, generator=g, dtype=torch.float64), -1)
    top = teacher_full.topk(K, dim=-1).indices
    in_top = torch.zeros(B, S, V, dtype=torch.bool).scatter_(-1, top, True)
    tail = torch.stack(
        [
            student_full.masked_fill(in_top, -math.inf).logsumexp(-1),
            teacher_full.masked_fill(in_top, -math.inf).logsumexp(-1),
        ],
        dim=-1,
    )
    inputs = {
        "student_topk_logprobs": student_full.gather(-1, top),
        "teacher_topk_logprobs": teacher_full.gather(-1, top),
        "H_all": tail,
    }
    token_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 1], [0, 1, 0, 0]])
    data = {"token_mask": token_mask, "sample_mask": torch.tensor([1, 1, 0, 1, 1, 1])}
    return data, inputs, student_full, in_top


def counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return data["sample_mask"].sum(), (data["token_mask"] * data["sample_mask"][:, None]).sum()


def reference(kl_type: str, weight: float, data, inputs, student_full, in_top) -> tuple[float, float, float]:
    """Forward/reverse KL over (top-k tokens + one bucket of the rest), from full distributions."""
    total_f = total_r = 0.0
    n = 0
    for b in range(B):
        for t in range(S):
            if not (data["sample_mask"][b] and data["token_mask"][b, t]):
                continue
            n += 1
            p_top = [math.exp(x) for x in inputs["teacher_topk_logprobs"][b, t].tolist()]
            q_top = [math.exp(x) for x in inputs["student_topk_logprobs"][b, t].tolist()]
            q_rest = sum(math.exp(float(student_full[b, t, v])) for v in range(V) if not in_top[b, t, v])
            p = p_top + [1 - sum(p_top)]
            q = q_top + [q_rest]
            total_f += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
            total_r += sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))
    forward, reverse = total_f / n, total_r / n
    loss = {"forward": forward, "reverse": reverse, "mixed": (1 - weight) * forward + weight * reverse}[kl_type]
    return loss, forward, reverse


@pytest.mark.parametrize(("kl_type", "weight"), [("forward", 0.5), ("reverse", 0.5), ("mixed", 0.3)])
def test_matches_reference(kl_type: str, weight: float) -> None:
    data, inputs, student_full, in_top = make_batch()
    loss, metrics = DistillationLossFn({"kl_type": kl_type, "mixed_kl_weight": weight})(data, *counts(data), **inputs)
    expected, forward, reverse = reference(kl_type, weight, data, inputs, student_full, in_top)
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert metrics["forward_kl"] == pytest.approx(forward, rel=1e-10)
    assert metrics["reverse_kl"] == pytest.approx(reverse, rel=1e-10)
    assert metrics["num_valid_samples"] == 5.0
    assert DistillationLossFn.loss_type is LossType.TOKEN_LEVEL


def test_identical_distributions_give_zero() -> None:
    data, inputs, _, _ = make_batch()
    same = {**inputs, "teacher_topk_logprobs": inputs["student_topk_logprobs"], "H_all": inputs["H_all"][..., :1].repeat(1, 1, 2)}
    loss, metrics = DistillationLossFn({"kl_type": "mixed"})(data, *counts(data), **same)
    assert loss.item() == pytest.approx(0.0, abs=1e-15)
    assert metrics["reverse_kl"] == pytest.approx(0.0, abs=1e-15)


def test_zero_tail_mass_is_finite() -> None:
    data, inputs, _, _ = make_batch()
    teacher = torch.log_softmax(inputs["teacher_topk_logprobs"], -1)
    tail = inputs["H_all"].clone()
    tail[..., 1] = -math.inf
    student = inputs["student_topk_logprobs"].clone().requires_grad_()
    loss, _ = DistillationLossFn({"kl_type": "forward"})(
        data, *counts(data), student_topk_logprobs=student, teacher_topk_logprobs=teacher, H_all=tail
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_microbatch_invariance(kl_type: str, split_invariance) -> None:
    data, inputs, _, _ = make_batch(1)
    split_invariance(DistillationLossFn({"kl_type": kl_type}), data, inputs, *counts(data))


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_gradcheck(kl_type: str) -> None:
    data, inputs, _, _ = make_batch(2)
    gseqs, gtoks = counts(data)
    loss_fn = DistillationLossFn({"kl_type": kl_type})

    def f(student: torch.Tensor, student_tail: torch.Tensor) -> torch.Tensor:
        tail = torch.cat([student_tail, inputs["H_all"][..., 1:]], dim=-1)
        return loss_fn(data, gseqs, gtoks, student_topk_logprobs=student, teacher_topk_logprobs=inputs["teacher_topk_logprobs"], H_all=tail)[0]

    args = (inputs["student_topk_logprobs"].clone().requires_grad_(), inputs["H_all"][..., :1].clone().requires_grad_())
    assert torch.autograd.gradcheck(f, args)


def test_bad_inputs() -> None:
    data, inputs, _, _ = make_batch()
    gseqs, gtoks = counts(data)
    loss_fn = DistillationLossFn({"kl_type": "forward"})
    with pytest.raises(ValueError, match=r"'H_all' must have shape \[batch, seq, 2\]"):
        loss_fn(data, gseqs, gtoks, **{**inputs, "H_all": inputs["H_all"][..., 0]})
    with pytest.raises(ValueError, match=r"'teacher_topk_logprobs' must have shape \[batch, seq, k\]=\[6, 4, 3\]"):
        loss_fn(data, gseqs, gtoks, **{**inputs, "teacher_topk_logprobs": inputs["teacher_topk_logprobs"][..., :2]})
    with pytest.raises(TypeError, match="H_all"):
        loss_fn(data, gseqs, gtoks, student_topk_logprobs=inputs["student_topk_logprobs"], teacher_topk_logprobs=inputs["teacher_topk_logprobs"])
    with pytest.raises(ValueError, match="kl_type"):
        DistillationLossFn({"kl_type": "js"})
    with pytest.raises(ValueError, match="mixed_kl_weight"):
        DistillationLossFn({"kl_type": "mixed", "mixed_kl_weight": 1.5})
