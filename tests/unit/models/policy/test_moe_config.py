"""Mixture-of-experts settings of ``policy.megatron_cfg``: field checks, layout checks against
the tiny MoE model (4 experts, top-2, 2 layers) before any actor starts, and the router's
training settings handed to megatron-core."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from megatron_bridge import BridgeConfig
from nemo_rl.models.policy.config import MegatronConfig, PolicyConfig
from nemo_rl.models.policy.parallel_layout import ParallelLayout, plan_parallel_layout
from nemo_rl.models.policy.workers.megatron.moe import moe_overrides


@pytest.fixture(scope="module")
def moe_path() -> Path:
    from nemo_rl.models.model_path import resolve_model_path

    return Path(resolve_model_path("tiny-qwen3-moe"))


def _cfg(**megatron: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {"megatron_cfg": megatron, "train_global_batch_size": 8, "train_micro_batch_size": 1}
    )


def test_expert_parallel_layout_keeps_dp(moe_path: Path) -> None:
    layout = plan_parallel_layout(_cfg(expert_model_parallel_size=4), moe_path, world_size=4)
    assert layout == ParallelLayout(pp=1, dp=4, cp=1, tp=1)


@pytest.mark.parametrize(
    ("megatron", "world", "needles"),
    [
        # 4 experts cannot be split whole over 3 ranks
        ({"expert_model_parallel_size": 3}, 3, ["expert_model_parallel_size=3", "num_local_experts (4)"]),
        # EP ranks come out of DP x CP: 2 x 2 x 1 = 4 does not divide 2 ranks
        (
            {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True},
            2,
            ["2 ranks", "expert_model_parallel_size", "= 4"],
        ),
        ({"tensor_model_parallel_size": 2}, 2, ["sequence_parallel=true", "mixture-of-experts"]),
    ],
)
def test_bad_moe_layout_names_the_field(
    moe_path: Path, megatron: dict, world: int, needles: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        plan_parallel_layout(_cfg(**megatron), moe_path, world_size=world)
    for needle in needles:
        assert needle in str(err.value)


def test_expert_parallelism_needs_experts(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="expert_model_parallel_size=2.*no experts"):
        plan_parallel_layout(_cfg(expert_model_parallel_size=2), tiny_llama_path, world_size=2)


def test_expert_tensor_parallel_size_other_than_tp_is_refused() -> None:
    with pytest.raises(ValidationError, match="expert_tensor_parallel_size=1 differs"):
        MegatronConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
    assert MegatronConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=2)


def test_router_settings_default_to_the_checkpoint(moe_path: Path, tiny_llama_path: Path) -> None:
    bridge = BridgeConfig.from_hf(moe_path)
    assert moe_overrides(MegatronConfig(), bridge) == {
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.001,  # the checkpoint's router_aux_loss_coef
        "moe_z_loss_coeff": None,
    }
    chosen = MegatronConfig(
        moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3, moe_router_dtype="fp64"
    )
    assert moe_overrides(chosen, bridge)["moe_aux_loss_coeff"] == 0.0
    assert moe_overrides(chosen, bridge)["moe_router_dtype"] == "fp64"
    assert moe_overrides(MegatronConfig(), BridgeConfig.from_hf(tiny_llama_path)) == {}
