"""Shared by the shard planner and BatchedDataDict tests: budget args and random sharding cases."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from nemo_rl.distributed.shard_planner import DynamicBatchingArgs, SequencePackingArgs

ALGORITHMS = ["first_fit_decreasing", "modified_first_fit_decreasing"]


def dynamic_args(budget: int, round_to: int) -> DynamicBatchingArgs:
    """Dynamic batching over ``input_ids`` / ``input_lengths`` with a token budget."""
    return DynamicBatchingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        max_tokens_per_microbatch=budget,
        sequence_length_round=round_to,
    )


def packing_args(
    budget: int, round_to: int, algorithm: str = "first_fit_decreasing"
) -> SequencePackingArgs:
    """Sequence packing over ``input_ids`` / ``input_lengths`` with a token budget."""
    return SequencePackingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        max_tokens_per_microbatch=budget,
        algorithm=algorithm,  # type: ignore[typeddict-item]
        sequence_length_round=round_to,
    )


def mode_kwargs(case: dict[str, Any], mode: str) -> dict[str, Any]:
    """The keyword arguments selecting ``mode`` ("plain", "dynamic", "packed") for ``case``."""
    if mode == "dynamic":
        return {"dynamic_batching_args": dynamic_args(case["budget"], case["round_to"])}
    if mode == "packed":
        return {
            "sequence_packing_args": packing_args(
                case["budget"], case["round_to"], case["algorithm"]
            )
        }
    return {}


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@st.composite
def sharding_cases(draw: st.DrawFn) -> dict[str, Any]:
    """Shards, global batch size (a multiple of shards), lengths, rounding and a token budget
    that every sample fits."""
    shards = draw(st.integers(1, 4))
    per_shard = draw(st.integers(1, 4))
    global_batches = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 24))
    total = shards * per_shard * global_batches
    # Mostly short or mostly long samples, so budgets split shards into differing counts.
    short = st.integers(1, max(1, seq_len // 4))
    length = st.one_of(short, st.integers(1, seq_len), st.integers((seq_len + 1) // 2, seq_len))
    lengths = draw(st.lists(length, min_size=total, max_size=total))
    round_to = draw(st.sampled_from([1, 4, 8]))
    longest = round_up(max(lengths), round_to)
    budget = longest * draw(st.integers(1, per_shard + 1)) + draw(st.integers(0, longest))
    return {
        "shards": shards,
        "batch_size": shards * per_shard,
        "seq_len": seq_len,
        "lengths": lengths,
        "round_to": round_to,
        "budget": budget,
        "algorithm": draw(st.sampled_from(ALGORITHMS)),
    }
