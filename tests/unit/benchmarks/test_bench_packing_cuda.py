"""The GPU packing benchmark's batch: GRPO-shaped response lengths, seeded."""

from benchmarks.bench_packing_cuda import response_lengths


def test_response_lengths_are_seeded_and_skewed() -> None:
    lengths = response_lengths(128, 2048)
    assert lengths == response_lengths(128, 2048)  # the same batch in every mode and run
    assert len(lengths) == 128 and sum(n == 2048 for n in lengths) == 12  # 10 %, at the limit
    short = [n for n in lengths if n != 2048]
    assert min(short) >= 1 and max(short) <= 512
    assert response_lengths(16, 64) != response_lengths(16, 64, seed=1)
    small = response_lengths(16, 64)
    assert max(small) == 64 and sum(n == 64 for n in small) >= 1
