"""The worker benchmarks' GRPO-shaped batch (CPU ``grpo_packed`` phase, GPU packing benchmark):
seeded, skewed response lengths."""

import pytest

from benchmarks.bench_megatron_worker_train import grpo_response_lengths, workload


def test_response_lengths_are_seeded_and_skewed() -> None:
    lengths = grpo_response_lengths(128, 2048)
    assert lengths == grpo_response_lengths(128, 2048)  # the same batch in every mode and run
    assert len(lengths) == 128 and sum(n == 2048 for n in lengths) == 12  # 10 %, at the limit
    short = [n for n in lengths if n != 2048]
    assert min(short) >= 1 and max(short) <= 512
    assert grpo_response_lengths(16, 64) != grpo_response_lengths(16, 64, seed=1)
    small = grpo_response_lengths(16, 64)
    assert max(small) == 64 and sum(n == 64 for n in small) >= 1


def test_grpo_workload_is_prompt_plus_response_within_its_row() -> None:
    lengths, row, rows_per_micro_batch = workload("grpo")
    assert len(lengths) == 128 and row == 24 + 128 and rows_per_micro_batch == 32
    assert min(lengths) >= 25 and max(lengths) == row
    assert workload("skewed")[1] == 512 and workload("uniform") == ((256,) * 8, 256, 2)
    assert workload("grpo_equal") == ((88,) * 128, 88, 32)  # the 40 M GRPO case's rows
    with pytest.raises(ValueError, match="unknown workload 'grpo_packed'"):
        workload("grpo_packed")
