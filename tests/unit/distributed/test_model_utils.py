"""Vocab-parallel log-probs, masked log-probs and top-k against plain full-vocabulary torch references.

Single-process tests run the TP=1 path; the two-rank tests spawn 2 gloo processes once (a
module-scoped fixture), each holding half the vocabulary, and compare every scenario's output
and per-shard gradient with the references computed on the whole vocabulary.
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_rl.distributed.model_utils import (
    distributed_topk_logits,
    from_parallel_logits_to_logprobs,
    masked_logprobs,
    vocab_range_for_rank,
)

BATCH, SEQ, VOCAB = 3, 9, 96


def make_inputs(dtype: torch.dtype = torch.float64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Peaked random logits [BATCH, SEQ, VOCAB], targets [BATCH, SEQ] (half the argmax), weights [BATCH, SEQ]."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)).to(dtype)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    # Next-token argmax for even positions: always inside any top-k / top-p set.
    argmax_next = torch.nn.functional.pad(logits[:, :-1].argmax(-1), (1, 0))
    target[:, ::2] = argmax_next[:, ::2]
    weights = torch.rand(BATCH, SEQ, generator=gen, dtype=torch.float64)
    return logits, target, weights


def ref_logprobs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log_softmax + gather with the next-token shift; position 0 = 0."""
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, target[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def ref_masked_logprobs(logits: torch.Tensor, target: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """vLLM sampler semantics: top-k (keep >= k-th largest), then top-p on the ascending-sorted
    softmax (drop tokens whose ascending cumulative mass <= 1 - p, keep the largest), renormalise."""
    x = logits[:, :-1]
    if top_k is not None:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p is not None:
        ascending, order = x.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    lp = torch.log_softmax(x, dim=-1).gather(-1, target[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def finite_loss(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over finite entries (masked-out targets score -inf)."""
    return (weights.to(out.dtype) * out.masked_fill(~torch.isfinite(out), 0.0)).sum()


def grad_of(fn, logits: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, d finite_loss / d logits) of ``fn(leaf)`` for a fresh leaf copy of ``logits``."""
    leaf = logits.detach().clone().requires_grad_()
    out = fn(leaf)
    finite_loss(out, weights).backward()
    return out.detach(), leaf.grad


# ---------------------------------------------------------------- single process


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
def test_logprobs_match_log_softmax_gather(dtype: torch.dtype, chunk_size: int | None) -> None:
    logits, target, weights = make_inputs(dtype)
    out, grad = grad_of(
        lambda x: from_parallel_logits_to_logprobs(x, target, 0, VOCAB, None, chunk_size=chunk_size), logits, weights
    )
    ref, ref_grad = grad_of(lambda x: ref_logprobs(x, target), logits, weights)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert out.shape == (BATCH, SEQ) and out.dtype == dtype
    assert torch.all(out[:, 0] == 0)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)
    assert torch.all(grad[:, -1] == 0), "the last position predicts nothing that is scored"


def test_alignment_uses_previous_position() -> None:
    # One-hot logits: position t-1 puts all mass (in the limit) on token t's id.
    target = torch.tensor([[0, 1, 2, 3]])
    logits = torch.full((1, 4, 5), -50.0, dtype=torch.float64)
    for t in range(3):
        logits[0, t, target[0, t + 1]] = 50.0
    out = from_parallel_logits_to_logprobs(logits, target, 0, 5, None)
    assert out[0, 0] == 0
    assert torch.all(out[0, 1:] > -1e-30)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_gradcheck_float64(chunk_size: int | None) -> None:
    logits, target, _ = make_inputs(torch.float64)
    logits = logits[:, :5, :13].contiguous().requires_grad_()
    target = target[:, :5] % 13
    assert torch.autograd.gradcheck(
        lambda x: from_parallel_logits_to_logprobs(x, target, 0, 13, None, chunk_size=chunk_size), (logits,)
    )


def test_chunked_equals_unchunked_float32() -> None:
    logits, target, weights = make_inputs(torch.float32, seed=1)
    out, grad = grad_of(lambda x: from_parallel_logits_to_logprobs(x, target, 0, VOCAB, None), logits, weights)
    for chunk_size in (1, 3, SEQ - 1, SEQ + 5):
        out_c, grad_c = grad_of(
            lambda x: from_parallel_logits_to_logprobs(x, target, 0, VOCAB, None, chunk_size=chunk_size), logits, weights
        )
        torch.testing.assert_close(out_c, out, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad_c, grad, rtol=1e-6, atol=1e-7)


def test_bfloat16_accumulates_in_float32() -> None:
    logits, target, weights = make_inputs(torch.bfloat16)
    out, grad = grad_of(
        lambda x: from_parallel_logits_to_logprobs(x, target, 0, VOCAB, None, chunk_size=4), logits, weights
    )
    ref, ref_grad = grad_of(lambda x: ref_logprobs(x, target), logits.double(), weights)
    assert out.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_inference_only_builds_no_graph() -> None:
    logits, target, _ = make_inputs(torch.float32)
    logits.requires_grad_()
    out = from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None, inference_only=True, chunk_size=2)
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref_logprobs(logits.detach(), target), rtol=1e-6, atol=1e-6)


def test_single_position_sequence_scores_nothing() -> None:
    logits = torch.randn(2, 1, 7, dtype=torch.float64, requires_grad=True)
    out = from_parallel_logits_to_logprobs(logits, torch.zeros(2, 1, dtype=torch.long), 0, 7, None, chunk_size=3)
    out.sum().backward()
    assert torch.all(out == 0) and torch.all(logits.grad == 0)


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(1, None), (5, None), (None, 0.6), (None, 0.95), (7, 0.5), (VOCAB, 0.8)]
)
def test_masked_logprobs_match_sampler_semantics(top_k: int | None, top_p: float | None) -> None:
    logits, target, weights = make_inputs(torch.float64, seed=2)
    out, grad = grad_of(
        lambda x: masked_logprobs(x, target, 0, VOCAB, None, top_k=top_k, top_p=top_p, top_p_candidates=None),
        logits,
        weights,
    )
    ref, ref_grad = grad_of(lambda x: ref_masked_logprobs(x, target, top_k, top_p), logits, weights)
    finite = torch.isfinite(ref)
    assert finite[:, 1:].any()
    assert torch.equal(torch.isfinite(out), finite)
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
    if top_k is not None and top_k < 3:
        assert not finite.all(), "random targets must fall outside a tiny top-k set"


def test_masked_logprobs_without_truncation_equal_plain_logprobs() -> None:
    logits, target, _ = make_inputs(torch.float64)
    plain = from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None)
    torch.testing.assert_close(masked_logprobs(logits, target, 0, VOCAB, None, top_p=1.0), plain)
    torch.testing.assert_close(masked_logprobs(logits, target, 0, VOCAB, None, top_k=VOCAB), plain)


def test_top_p_candidate_cap_too_small_raises() -> None:
    logits, target, _ = make_inputs(torch.float64)
    with pytest.raises(ValueError, match="top_p_candidates"):
        masked_logprobs(logits / 100, target, 0, VOCAB, None, top_p=0.9, top_p_candidates=4)


def test_distributed_topk_single_process_matches_topk() -> None:
    logits, _, _ = make_inputs(torch.float32)
    values, indices = distributed_topk_logits(logits, 6, 0, None)
    ref = torch.topk(logits, 6, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)


def test_vocab_range_for_rank() -> None:
    assert [vocab_range_for_rank(96, r, 4) for r in range(4)] == [(0, 24), (24, 48), (48, 72), (72, 96)]
    assert vocab_range_for_rank(10, 0, 1) == (0, 10)
    with pytest.raises(ValueError, match="vocab_size_padded"):
        vocab_range_for_rank(10, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        vocab_range_for_rank(12, 4, 4)


# ---------------------------------------------------------------- errors


def test_target_shape_mismatch_names_argument_and_shape() -> None:
    logits, target, _ = make_inputs(torch.float32)
    with pytest.raises(ValueError, match=rf"target must have shape \[batch, seq\] = \[{BATCH}, {SEQ}\]"):
        from_parallel_logits_to_logprobs(logits, target[:, 1:], 0, VOCAB, None)
    with pytest.raises(ValueError, match="target must have shape"):
        masked_logprobs(logits, target[None], 0, VOCAB, None, top_k=2)


@pytest.mark.parametrize("bad_id", [VOCAB, -1])
def test_target_outside_vocab_raises(bad_id: int) -> None:
    logits, target, _ = make_inputs(torch.float32)
    target[1, 4] = bad_id
    with pytest.raises(ValueError, match=rf"target\[1, 4\] = {bad_id} is outside the vocabulary"):
        from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None, chunk_size=2)
    with pytest.raises(ValueError, match=r"target\[1, 4\]"):
        masked_logprobs(logits, target, 0, VOCAB, None, top_k=3)


def test_other_bad_arguments_raise() -> None:
    logits, target, _ = make_inputs(torch.float32)
    with pytest.raises(TypeError, match="target must hold integer"):
        from_parallel_logits_to_logprobs(logits, target.float(), 0, VOCAB, None)
    with pytest.raises(ValueError, match="vocab_parallel_logits must be"):
        from_parallel_logits_to_logprobs(logits[0], target, 0, VOCAB, None)
    with pytest.raises(ValueError, match="vocab_start_index, vocab_end_index"):
        from_parallel_logits_to_logprobs(logits, target, 0, VOCAB // 2, None)
    with pytest.raises(ValueError, match="chunk_size"):
        from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None, chunk_size=0)
    with pytest.raises(ValueError, match="top_k"):
        masked_logprobs(logits, target, 0, VOCAB, None, top_k=VOCAB + 1)
    with pytest.raises(ValueError, match="top_p"):
        masked_logprobs(logits, target, 0, VOCAB, None, top_p=0.0)
    with pytest.raises(ValueError, match="k must be"):
        distributed_topk_logits(logits, 0, 0, None)


# ---------------------------------------------------------------- two gloo ranks

TP = 2
MASKED_SETTINGS = {"top_k": dict(top_k=5), "top_k_top_p": dict(top_k=9, top_p=0.7), "top_p": dict(top_p=0.6)}
TOPK = 7


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tp_worker(rank: int, port: int, out_dir: str, logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> None:
    """One TP rank: run every scenario on this rank's vocab shard and save the results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP, timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        start, end = vocab_range_for_rank(VOCAB, rank, TP)
        shard = logits[..., start:end]  # non-contiguous on purpose: gloo needs the kernel to copy
        results: dict[str, object] = {}
        for name, chunk_size in (("plain", None), ("chunked", 2)):
            results[name] = grad_of(
                lambda x: from_parallel_logits_to_logprobs(x, target, start, end, group, chunk_size=chunk_size),
                shard,
                weights,
            )
        for name, settings in MASKED_SETTINGS.items():
            results[name] = grad_of(
                lambda x: masked_logprobs(x, target, start, end, group, top_p_candidates=16, **settings),
                shard,
                weights,
            )
        results["topk"] = distributed_topk_logits(shard, TOPK, start, group)
        bad = target.clone()
        bad[0, 3] = VOCAB
        try:
            from_parallel_logits_to_logprobs(shard, bad, start, end, group, chunk_size=2)
        except ValueError as err:
            results["error"] = str(err)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[torch.Tensor, ...], list[dict]]:
    """Inputs (float32) and both ranks' results, from one 2-process gloo run."""
    inputs = make_inputs(torch.float32, seed=3)
    out_dir = tmp_path_factory.mktemp("tp2")
    mp.spawn(_tp_worker, args=(_free_port(), str(out_dir), *inputs), nprocs=TP, join=True)
    return inputs, [torch.load(out_dir / f"rank{r}.pt") for r in range(TP)]


@pytest.mark.parametrize("scenario", ["plain", "chunked"])
def test_two_ranks_logprobs_and_shard_gradients(two_rank_results, scenario: str) -> None:
    (logits, target, weights), ranks = two_rank_results
    ref, ref_grad = grad_of(lambda x: ref_logprobs(x, target), logits, weights)
    for rank, results in enumerate(ranks):
        out, grad = results[scenario]
        start, end = vocab_range_for_rank(VOCAB, rank, TP)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad[..., start:end], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scenario", sorted(MASKED_SETTINGS))
def test_two_ranks_masked_logprobs(two_rank_results, scenario: str) -> None:
    (logits, target, weights), ranks = two_rank_results
    settings = MASKED_SETTINGS[scenario]
    ref, ref_grad = grad_of(
        lambda x: ref_masked_logprobs(x, target, settings.get("top_k"), settings.get("top_p")), logits.double(), weights
    )
    finite = torch.isfinite(ref)
    assert finite[:, 1:].any() and not finite.all()
    for rank, results in enumerate(ranks):
        out, grad = results[scenario]
        start, end = vocab_range_for_rank(VOCAB, rank, TP)
        assert torch.equal(torch.isfinite(out), finite)
        torch.testing.assert_close(out[finite].double(), ref[finite], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.double(), ref_grad[..., start:end], rtol=1e-5, atol=1e-5)


def test_two_ranks_distributed_topk_and_range_error(two_rank_results) -> None:
    (logits, _, _), ranks = two_rank_results
    ref = torch.topk(logits, TOPK, dim=-1)
    for results in ranks:
        values, indices = results["topk"]
        assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
        assert "target[0, 3] = 96 is outside the vocabulary" in results["error"]
