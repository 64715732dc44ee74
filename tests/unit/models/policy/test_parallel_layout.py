"""Parallel-layout checks run in the driver before any actor starts (tiny Llama: 4 heads,
2 KV heads, 2 layers, FFN 256)."""

from __future__ import annotations

from typing import Any

import pytest

from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.parallel_layout import ParallelLayout, plan_parallel_layout


def _cfg(tp: int = 1, pp: int = 1, cp: int = 1, **policy: Any) -> PolicyConfig:
    megatron = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        **policy.pop("megatron", {}),
    }
    return PolicyConfig.model_validate({"megatron_cfg": megatron, **policy})


def test_valid_layout_derives_dp(tiny_llama_path):
    layout = plan_parallel_layout(_cfg(tp=2), tiny_llama_path, world_size=4)
    assert layout == ParallelLayout(pp=1, dp=2, cp=1, tp=2)
    assert layout.axes() == {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    assert layout.world_size == 4


@pytest.mark.parametrize(
    ("cfg_kwargs", "world", "needles"),
    [
        ({"tp": 2}, 3, ["3 ranks", "tensor_model_parallel_size", "= 2"]),
        # 2 KV heads cannot be split over 4 TP ranks: silently wrong if allowed.
        ({"tp": 4}, 4, ["tensor_model_parallel_size=4", "num_key_value_heads (2)"]),
        ({"pp": 4}, 4, ["pipeline_model_parallel_size=4", "num_hidden_layers (2)"]),
        (
            {"cp": 2, "max_total_sequence_length": 250},
            2,
            ["policy.max_total_sequence_length (250)", "context_parallel_size = 4"],
        ),
        (
            {"cp": 2, "dynamic_batching": {"enabled": True, "sequence_length_round": 6}},
            2,
            ["sequence_length_round (6)"],
        ),
        (
            {"train_global_batch_size": 30, "train_micro_batch_size": 2},
            4,
            ["train_global_batch_size (30)", "data-parallel size (4"],
        ),
        (
            {"train_global_batch_size": 16, "train_micro_batch_size": 8},
            4,
            ["16 / 4 = 4 samples per rank", "train_micro_batch_size (8)"],
        ),
    ],
)
def test_invalid_layouts_name_the_field(tiny_llama_path, cfg_kwargs, world, needles):
    with pytest.raises(ValueError) as excinfo:
        plan_parallel_layout(
            _cfg(**cfg_kwargs), tiny_llama_path, world_size=world
        )
    for needle in needles:
        assert needle in str(excinfo.value)


def test_token_budget_batching_skips_micro_batch_divisibility(tiny_llama_path):
    cfg = _cfg(
        train_global_batch_size=16,
        train_micro_batch_size=8,
        sequence_packing={"enabled": True},
    )
    assert plan_parallel_layout(cfg, tiny_llama_path, world_size=4).dp == 4


def test_unknown_model_skips_only_the_model_checks(tiny_llama_path):
    """Config time: a hub model not downloaded (None) skips the model checks; the rest still
    runs."""
    assert plan_parallel_layout(_cfg(tp=4), None, world_size=4).tp == 4
    with pytest.raises(ValueError, match="change those sizes or cluster.num_nodes"):
        plan_parallel_layout(_cfg(tp=2), None, world_size=3, world_source="cluster.num_nodes")


def test_sequence_parallel_needs_tp_not_transformer_engine(tiny_llama_path):
    """The local layer spec's norm supports sequence parallelism: TP=2 with it is a valid
    layout with or without TransformerEngine; at TP=1 the config refuses it."""
    sp = _cfg(tp=2, megatron={"sequence_parallel": True})
    assert plan_parallel_layout(sp, tiny_llama_path, world_size=2).tp == 2
    with pytest.raises(ValueError, match="sequence_parallel=true .* tensor_model_parallel_size > 1"):
        _cfg(megatron={"sequence_parallel": True})
