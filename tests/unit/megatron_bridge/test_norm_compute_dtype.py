"""The local spec's norms run in the input's dtype (the weight cast in the forward): float32
unchanged bit for bit; bf16 through torch's fused kernel (no dtype-mismatch warning) and equal
to the float32-weight norm within one bf16 rounding of the output (relative 2**-7: the weight's
rounding to bf16 plus the output's); parameters and their gradients stay float32."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_bridge.norm import ComputeDtypeLayerNorm, ComputeDtypeRMSNorm

BF16_RTOL = 2.0**-7


def _pair(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the old torch norm, ours) with the same non-trivial float32 parameters."""
    torch.manual_seed(0)
    old = {"rms": torch.nn.RMSNorm, "layer": torch.nn.LayerNorm}[kind](64, eps=1e-6)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ours = {"rms": ComputeDtypeRMSNorm, "layer": ComputeDtypeLayerNorm}[kind](64, eps=1e-6)
    ours.load_state_dict(old.state_dict())
    return old, ours


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_float32_is_unchanged(kind: str) -> None:
    old, ours = _pair(kind)
    x = torch.randn(3, 5, 64)
    assert torch.equal(ours(x), old(x))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_bf16_runs_in_bf16_and_matches_the_float32_weight_norm(kind: str) -> None:
    old, ours = _pair(kind)
    x = (torch.randn(3, 5, 64) * 2).to(torch.bfloat16).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "cannot dispatch to fused implementation"
        out = ours(x)
    expected = old(x.detach()).float()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=BF16_RTOL, atol=BF16_RTOL)
    out.float().sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in ours.parameters())
    assert ours.weight.grad.abs().sum() > 0
