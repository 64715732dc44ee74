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


def test_packed_causal_attention_matches_block_diagonal_reference() -> None:
    torch.manual_seed(0)
    cu = [0, 5, 6, 13, 20]  # sequences of 5, 1, 7 and 7 tokens, then 4 rows of row padding
    t, heads, groups, dim = 24, 4, 2, 8
    q = torch.randn(t, heads, dim, requires_grad=True)
    k, v = (torch.randn(t, groups, dim, requires_grad=True) for _ in range(2))
    assert not varlen_applies(q)  # CPU: the per-sequence kernel
    out = packed_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 7, 0.3)
    assert out.shape == (t, heads, dim)
    torch.testing.assert_close(out.double(), _reference(q, k, v, cu, 0.3), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[20:], torch.zeros(4, heads, dim))
    out.sum().backward()  # differentiable; the padding rows feed nothing
    assert torch.equal(q.grad[20:], torch.zeros(4, heads, dim))


def test_varlen_kernel_matches_per_sequence_on_cuda() -> None:
    """On a GPU in bf16 the pack runs torch's varlen flash-attention kernel: same outputs and
    gradients as the per-sequence kernel, to bf16 rounding."""
    from nemo_rl.models.megatron.packed_attention import per_sequence_causal, varlen_causal

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
        lambda q, k, v: per_sequence_causal(q, k, v, cu, 0.125),
    ):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attend(*leaves)
        out.float().square().sum().backward()
        results.append([out, *(x.grad for x in leaves)])
    for fast, slow in zip(*results):
        torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(results[0][0][2048:], torch.zeros_like(results[0][0][2048:]))
