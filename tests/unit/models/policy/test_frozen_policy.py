"""A policy worker built with ``init_optimizer=False`` (a distillation teacher) on one
in-process Megatron rank (tiny Llama, no Ray): it holds no optimizer, scheduler or DDP gradient
buffers, its parameters need no gradient, it scores exactly like the bare model, and training
or saving a training checkpoint fails with a message naming the fix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.workers.megatron.model_setup import FrozenStage
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

from one_rank_worker import one_rank_worker, token_batch

LENGTHS = (8, 5, 7, 3)
SEQ = 8


@pytest.fixture(scope="module")
def frozen(tiny_llama_path: Path) -> Iterator[MegatronPolicyWorker]:
    with one_rank_worker(tiny_llama_path, len(LENGTHS), SEQ, init_optimizer=False) as worker:
        yield worker


@pytest.fixture(scope="module")
def batch() -> BatchedDataDict:
    return token_batch(LENGTHS, SEQ)


def test_holds_no_optimizer_scheduler_or_gradient_buffers(frozen: MegatronPolicyWorker) -> None:
    policy = frozen.policy
    assert policy.optimizer is None and policy.scheduler is None
    assert isinstance(policy.model, FrozenStage)  # not megatron's DDP: no grad_data buffers
    params = list(policy.model.parameters())
    assert params and not any(p.requires_grad for p in params)
    assert not any(hasattr(p, "main_grad") or p.grad is not None for p in params)


def test_scores_like_the_bare_model(frozen: MegatronPolicyWorker, batch: BatchedDataDict) -> None:
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = frozen.policy.model.module(ids, torch.arange(SEQ).expand_as(ids), attention_mask=None)
    # logprob of token t under the logits at t - 1; position 0 and padding are zero
    expected = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    got = frozen.get_logprobs(batch)["logprobs"]
    valid = torch.arange(1, SEQ)[None, :] < batch["input_lengths"][:, None]
    torch.testing.assert_close(got[:, 1:][valid].double(), expected[valid], atol=1e-5, rtol=0)
    assert not got[:, 0].any()


@pytest.mark.parametrize(
    ("verb", "action"),
    [
        (lambda w, b, tmp: w.train(b, NLLLoss()), "train"),
        (lambda w, b, tmp: w.train(b, NLLLoss(), eval_mode=True), "train"),
        (lambda w, b, tmp: w.reset_optimizer(), "reset the optimizer"),
        (lambda w, b, tmp: w.save_checkpoint(str(tmp / "ckpt")), "save a training checkpoint"),
        (lambda w, b, tmp: w.load_checkpoint(str(tmp / "ckpt")), "load a training checkpoint"),
    ],
)
def test_training_verbs_fail_with_the_fix(frozen, batch, tmp_path, verb, action) -> None:
    with pytest.raises(RuntimeError, match=rf"cannot {action}: .*init_optimizer=False.*init_optimizer=True"):
        verb(frozen, batch, tmp_path)
    assert frozen.get_train_step() == 0 and not (tmp_path / "ckpt").exists()
