"""Top-k distillation on one in-process Megatron worker (tiny Llama, no Ray): the teacher's
top-k values and indices equal ``torch.topk`` over its full-vocabulary logits, travel as
``[B, S, k]``, and the student's distillation loss equals one computed from full logits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nemo_rl.algorithms.loss import DistillationLossFn
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

from one_rank_worker import one_rank_worker, token_batch

LENGTHS = (16, 5, 11, 9)
SEQ, K = 16, 8


@pytest.fixture(scope="module")
def worker(tiny_llama_path: Path) -> Iterator[MegatronPolicyWorker]:
    with one_rank_worker(tiny_llama_path, len(LENGTHS), SEQ) as w:
        yield w


@pytest.fixture(scope="module")
def batch() -> BatchedDataDict:
    return token_batch(LENGTHS, SEQ)


@pytest.fixture(scope="module")
def full_logits(worker: MegatronPolicyWorker, batch: BatchedDataDict) -> torch.Tensor:
    """``[B, S, V]`` float64 logits of the whole vocabulary, shifted to the positions they
    predict (row t: logits at t - 1; row 0 unused)."""
    ids = batch["input_ids"]
    positions = torch.arange(SEQ).expand_as(ids)
    model = worker.policy.model
    model.eval()
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=None).double()
    return torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)


def _valid(batch: BatchedDataDict) -> torch.Tensor:
    return batch["token_mask"].bool()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_teacher_topk_equals_topk_of_full_logits(worker, batch, full_logits, temperature):
    out = worker.get_topk_logits(batch, K, temperature)
    values, ids = out["topk_logits"], out["topk_indices"]
    assert values.shape == ids.shape == (len(LENGTHS), SEQ, K)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    scaled = full_logits / temperature
    ref_values, ref_ids = torch.topk(torch.log_softmax(scaled, dim=-1), K, dim=-1)
    valid = _valid(batch)
    assert torch.equal(ids[valid], ref_ids[valid])
    torch.testing.assert_close(values[valid].double(), ref_values[valid], atol=1e-5, rtol=0)
    assert not values[~valid].any() and not ids[~valid].any()


def _reference_loss(full_logits, batch, teacher, kl_type, zero_outside_topk, temperature):
    """The distillation loss per valid token, from the student's full logits in float64."""
    values, ids = teacher["topk_logits"].double(), teacher["topk_indices"]
    student = torch.log_softmax(full_logits / temperature, dim=-1)
    picked = student.gather(-1, ids)
    if zero_outside_topk:
        log_q = torch.cat([picked, torch.log1p(-picked.exp().sum(-1, keepdim=True))], -1)
        log_p = torch.cat([values, torch.log1p(-values.exp().sum(-1, keepdim=True))], -1)
    else:
        log_q, log_p = torch.log_softmax(picked, -1), torch.log_softmax(values, -1)
    forward = (log_p.exp() * (log_p - log_q)).sum(-1)
    reverse = (log_q.exp() * (log_q - log_p)).sum(-1)
    per_token = {"forward": forward, "reverse": reverse, "mixed": 0.7 * forward + 0.3 * reverse}[kl_type]
    valid = _valid(batch)
    return float(per_token[valid].sum() / valid.sum())


@pytest.mark.parametrize("zero_outside_topk", [True, False])
@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_student_loss_equals_full_vocabulary_reference(
    worker, batch, full_logits, kl_type, zero_outside_topk
):
    # a teacher that differs from the student: the same model at temperature 2
    teacher = worker.get_topk_logits(batch, K, 2.0)
    data = BatchedDataDict(
        {**batch, "teacher_topk_logits": teacher["topk_logits"], "teacher_topk_indices": teacher["topk_indices"]}
    )
    loss_fn = DistillationLossFn(
        {"kl_type": kl_type, "mixed_kl_weight": 0.3, "zero_outside_topk": zero_outside_topk}
    )
    result = worker.train(data, loss_fn, eval_mode=True)
    expected = _reference_loss(full_logits, batch, teacher, kl_type, zero_outside_topk, 1.0)
    assert result["loss"][0] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_student_equal_to_teacher_has_zero_kl(worker, batch):
    teacher = worker.get_topk_logits(batch, K, 1.0)
    data = BatchedDataDict(
        {**batch, "teacher_topk_logits": teacher["topk_logits"], "teacher_topk_indices": teacher["topk_indices"]}
    )
    loss_fn = DistillationLossFn({"kl_type": "mixed", "zero_outside_topk": True})
    metrics = worker.train(data, loss_fn, eval_mode=True)["metrics"]
    assert abs(metrics["forward_kl"][0]) < 1e-5 and abs(metrics["reverse_kl"][0]) < 1e-5
