"""Causal attention over a pack: each sequence attends only to itself, causally."""

import math

import pytest
import torch

from nemo_rl.models.megatron.packed_attention import packed_causal_attention, varlen_applies


def _reference(q, k, v, cu, scale):
    """Float64 softmax attention under a block-diagonal causal mask; rows past cu[-1] zero."""
    t, heads, _ = q.shape
    k, v = (x.repeat_interleave(heads // x.size(1), dim=1).double() for x in (k, v))
    seq = torch.full((t,), -1)
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        seq[lo:hi] = i
    pos = torch.arange(t)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & (seq[:, None] >= 0)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize(
    "cu",
    [
        [0, 5, 6, 13, 20],  # sequences of 5, 1, 7 and 7 tokens, then 4 rows of row padding
        # sequences of 9, 17, 9, 9, 3, 30, 40, 9, 4: 17 and 30 share a 32-token bucket (17 is
        # padded to 30 rows), the four 9s, the 3 and the 4 share one of 16, 40 is alone
        [0, 9, 26, 35, 44, 47, 77, 117, 126, 130],
    ],
)
def test_packed_causal_attention_matches_block_diagonal_reference(cu: list[int]) -> None:
    """Outputs and the gradients of query, key and value equal a float64 reference."""
    torch.manual_seed(0)
    t, heads, groups, dim = cu[-1] + 4, 4, 2, 8
    q = torch.randn(t, heads, dim, requires_grad=True)
    k, v = (torch.randn(t, groups, dim, requires_grad=True) for _ in range(2))
    assert not varlen_applies(q)  # CPU: the bucketed kernel
    out = packed_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 40, 0.3)
    assert out.shape == (t, heads, dim)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = _reference(*leaves, cu, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[cu[-1]:], torch.zeros(4, heads, dim))
    weights = torch.randn(t, heads, dim)  # a loss whose gradient differs row by row
    (out * weights).sum().backward()
    (expected * weights.double()).sum().backward()
    for got, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(q.grad[cu[-1]:], torch.zeros(4, heads, dim))  # the padding feeds nothing


def test_length_buckets_group_similar_lengths_in_pack_order() -> None:
    from nemo_rl.models.megatron.packed_attention import BUCKET_TOKENS, length_buckets

    assert BUCKET_TOKENS == 16
    assert length_buckets([9, 17, 0, 9, 30, 16, 33]) == {1: [0, 3, 5], 2: [1, 4], 3: [6]}


def test_varlen_kernel_matches_bucketed_on_cuda() -> None:
    """On a GPU in bf16 the pack runs torch's varlen flash-attention kernel: same outputs and
    gradients as the bucketed SDPA kernel, to bf16 rounding."""
    from nemo_rl.models.megatron.packed_attention import bucketed_causal, varlen_causal

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    cu = [0, 300, 301, 1024, 1800, 2048]
    t, heads, groups, dim = 2100, 16, 4, 64
    inputs = [
        torch.randn(t, n, dim, device="cuda", dtype=torch.bfloat16) for n in (heads, groups, groups)
    ]
    assert varlen_applies(inputs[0])
    results = []
    for attend in (
        lambda q, k, v: varlen_causal(q, k, v, torch.tensor(cu, device="cuda"), 773, 0.125),
        lambda q, k, v: bucketed_causal(q, k, v, cu, 0.125),
    ):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attend(*leaves)
        out.float().square().sum().backward()
        results.append([out, *(x.grad for x in leaves)])
    for fast, slow in zip(*results):
        torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(results[0][0][2048:], torch.zeros_like(results[0][0][2048:]))
