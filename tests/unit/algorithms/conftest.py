"""Helpers for the loss tests: run a loss over micro-batches and add up what it returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

# Ways to split a batch of 6 rows (pairs kept together where sizes are even).
SPLITS_OF_6: tuple[tuple[int, ...], ...] = ((6,), (3, 3), (2, 2, 2), (1, 4, 1), (4, 2))


def run_in_microbatches(
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]],
    data: Mapping[str, torch.Tensor],
    inputs: Mapping[str, torch.Tensor],
    sizes: Sequence[int],
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Sum of the micro-batch losses, gradients of the float ``inputs`` and summed metrics.

    ``inputs`` are leaf tensors; fresh leaves are made so gradients do not accumulate across calls.
    """
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    total = torch.zeros((), dtype=torch.float64)
    metrics: dict[str, float] = {}
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        start += size
        micro_data = {k: v[rows] for k, v in data.items()}
        micro_inputs = {k: v[rows] for k, v in leaves.items()}
        loss, micro_metrics = loss_fn(micro_data, global_valid_seqs, global_valid_toks, **micro_inputs)
        assert loss.dim() == 0
        total = total + loss
        for name, value in micro_metrics.items():
            metrics[name] = metrics.get(name, 0.0) + value
    assert start == next(iter(data.values())).shape[0]
    total.backward()
    grads = {k: v.grad for k, v in leaves.items() if v.requires_grad}
    return total.detach(), grads, metrics


@pytest.fixture
def microbatch_runner() -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]]:
    """:func:`run_in_microbatches` as a fixture."""
    return run_in_microbatches


def assert_split_invariant(
    loss_fn, data, inputs, global_valid_seqs, global_valid_toks, splits: Sequence[Sequence[int]] = SPLITS_OF_6
) -> None:
    """Losses, gradients and metrics summed over each split equal those of the whole batch (6 rows by default)."""
    whole_loss, whole_grads, whole_metrics = run_in_microbatches(
        loss_fn, data, inputs, (next(iter(data.values())).shape[0],), global_valid_seqs, global_valid_toks
    )
    for sizes in splits:
        loss, grads, metrics = run_in_microbatches(loss_fn, data, inputs, sizes, global_valid_seqs, global_valid_toks)
        torch.testing.assert_close(loss, whole_loss, rtol=1e-10, atol=1e-12, msg=f"loss differs for split {sizes}")
        for name, grad in whole_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12, msg=f"grad of {name} differs for split {sizes}")
        assert metrics.keys() == whole_metrics.keys()
        for name, value in whole_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), f"metric {name} differs for split {sizes}"


@pytest.fixture
def split_invariance() -> Callable[..., None]:
    """:func:`assert_split_invariant` as a fixture."""
    return assert_split_invariant
