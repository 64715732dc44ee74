"""``policy.megatron_cfg.peft``: NeMo RL's keys and defaults, the checks that need no model
(names, fused groups, one list), and those against the model before any actor starts
(:func:`plan_parallel_layout` with the model's config.json): an entry the model lacks, the
experts of a mixture-of-experts model, a reward model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from megatron_bridge.lora_targets import LoraTarget, select_lora_targets
from nemo_rl.models.policy.config import PeftConfig, PolicyConfig
from nemo_rl.models.policy.parallel_layout import plan_parallel_layout
from nemo_rl.utils.config import ConfigError, validate_config


def _policy(**peft: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "megatron_cfg": {"peft": {"enabled": True, **peft}},
            "train_global_batch_size": 8,
            "train_micro_batch_size": 1,
        }
    )


def test_defaults_are_nemo_rls() -> None:
    peft = PeftConfig()
    assert peft.model_dump() == {
        "enabled": False,
        "target_modules": [],
        "exclude_modules": [],
        "dim": 32,
        "alpha": 32,
        "dropout": 0.0,
        "dropout_position": "pre",
        "lora_A_init_method": "xavier",
        "lora_B_init_method": "zero",
        "lora_dtype": None,
    }


@pytest.mark.parametrize(
    ("peft", "needles"),
    [
        ({"target_modules": ["qkv"]}, ["target_modules", "unknown module 'qkv'", "linear_qkv"]),
        ({"exclude_modules": ["mlp"]}, ["exclude_modules", "unknown module 'mlp'"]),
        ({"target_modules": ["q_proj", "v_proj"]}, ["['k_proj']", "linear_qkv", "list all of"]),
        ({"target_modules": ["gate_proj"]}, ["['up_proj']", "linear_fc1"]),
        (
            {"target_modules": ["linear_qkv"], "exclude_modules": ["linear_fc1"]},
            ["both set", "empty target_modules"],
        ),
        ({"dim": 0}, ["dim"]),
        ({"dropout": 1.0}, ["dropout"]),
        ({"dropout_position": "middle"}, ["dropout_position"]),
        ({"lora_A_init_method": "normal"}, ["lora_A_init_method", "xavier"]),
        ({"lora_B_init_method": "xavier"}, ["lora_B_init_method"]),
    ],
)
def test_bad_values_are_refused_naming_the_field(peft: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config({"megatron_cfg": {"peft": peft}}, PolicyConfig, source="test")
    for needle in needles:
        assert needle in str(err.value)


def test_a_reward_model_cannot_train_lora() -> None:
    with pytest.raises(ValidationError, match="reward model's new score head"):
        PolicyConfig.model_validate(
            {"megatron_cfg": {"peft": {"enabled": True}}, "reward_model_cfg": {"enabled": True}}
        )


@pytest.mark.parametrize(
    ("target", "exclude", "expected"),
    [
        # empty: every linear of every layer
        ([], [], [(layer, linear) for layer in (0, 1) for linear in
                  ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")]),
        # HF names select the Megatron linear that holds them
        (["q_proj", "k_proj", "v_proj", "down_proj"], [],
         [(0, "linear_qkv"), (0, "linear_fc2"), (1, "linear_qkv"), (1, "linear_fc2")]),
        # a pattern over full names with global layer indices
        (["*.layers.1.*.linear_qkv", "linear_proj"], [],
         [(0, "linear_proj"), (1, "linear_qkv"), (1, "linear_proj")]),
        ([], ["linear_fc1", "linear_fc2", "decoder.layers.0.self_attention.linear_proj"],
         [(0, "linear_qkv"), (1, "linear_qkv"), (1, "linear_proj")]),
    ],
)
def test_selection(target: list[str], exclude: list[str], expected: list[tuple[int, str]]) -> None:
    chosen = select_lora_targets(2, (), target, exclude)
    assert chosen == [LoraTarget(layer, linear) for layer, linear in expected]


def test_target_names_are_megatrons() -> None:
    target = LoraTarget(1, "linear_fc2")
    assert target.module_name() == "decoder.layers.1.mlp.linear_fc2"
    assert target.module_name(layer=0) == "decoder.layers.0.mlp.linear_fc2"  # a stage's own index
    assert LoraTarget.from_module_name("decoder.layers.0.mlp.linear_fc2", layer_offset=1) == target
    assert LoraTarget(0, "linear_qkv").parallel == "column" and target.parallel == "row"


def test_layouts_check_the_selection_against_the_model(tiny_llama_path: Path) -> None:
    layout = plan_parallel_layout(_policy(target_modules=["*.layers.1.*"]), tiny_llama_path, 1)
    assert layout.dp == 1
    with pytest.raises(ValueError) as err:
        plan_parallel_layout(_policy(target_modules=["*.layers.2.*.linear_qkv"]), tiny_llama_path, 1)
    for needle in ("policy.megatron_cfg.peft", str(tiny_llama_path), "'*.layers.2.*.linear_qkv'",
                   "matches no linear layer", "2 layers"):
        assert needle in str(err.value)
    with pytest.raises(ValueError, match="exclude_modules entry 'decoder.layers.0.mlp.linear_fc3'"):
        plan_parallel_layout(
            _policy(exclude_modules=["decoder.layers.0.mlp.linear_fc3"]), tiny_llama_path, 1
        )
    with pytest.raises(ValueError, match="adapts no linear layer"):
        plan_parallel_layout(_policy(exclude_modules=["*"]), tiny_llama_path, 1)


def test_experts_are_refused_attention_is_adapted() -> None:
    from nemo_rl.models.model_path import resolve_model_path

    moe_path = Path(resolve_model_path("tiny-qwen3-moe"))
    with pytest.raises(ValueError) as err:
        plan_parallel_layout(_policy(), moe_path, 1)  # default: every linear, experts included
    for needle in ("decoder.layers.0.mlp.linear_fc1", "mixture of experts",
                   "target_modules: [linear_qkv, linear_proj]", "exclude_modules"):
        assert needle in str(err.value)
    layout = plan_parallel_layout(_policy(exclude_modules=["linear_fc1", "linear_fc2"]), moe_path, 1)
    assert layout.dp == 1


def test_engines_serve_the_adapters_only_when_asked() -> None:
    from nemo_rl.models.generation.lora_serving import AdapterServing

    adapter = {"generation": {"vllm_cfg": {"lora_refit": "adapter"}}}
    assert PolicyConfig().generation.vllm_cfg.lora_refit == "merged"
    assert _policy(dim=8).adapter_serving() is None  # merged: the engines get every weight
    lora = {"megatron_cfg": {"peft": {"enabled": True, "dim": 20, "alpha": 10}}}
    serving = PolicyConfig.model_validate({**lora, **adapter}).adapter_serving()
    assert serving == AdapterServing(dim=20, alpha=10) and serving.max_lora_rank == 32


def test_adapter_refit_needs_lora_of_a_rank_vllm_serves() -> None:
    adapter = {"generation": {"vllm_cfg": {"lora_refit": "adapter"}}}
    with pytest.raises(ConfigError) as err:
        validate_config(
            {"megatron_cfg": {"peft": {"enabled": True, "dim": 513}}, **adapter},
            PolicyConfig, source="test",
        )
    for needle in ("megatron_cfg.peft.dim=513", "lora_refit='adapter'", "512", "merged"):
        assert needle in str(err.value)
    assert _policy(dim=513).adapter_serving() is None  # merged refit takes any rank
    with pytest.raises(ConfigError, match=r"lora_refit='adapter' serves LoRA adapters, but "
                       r"megatron_cfg.peft.enabled is false"):
        validate_config(adapter, PolicyConfig, source="test")


def test_max_lora_ranks_are_vllms() -> None:
    import typing

    from vllm.config.lora import MaxLoRARanks

    from nemo_rl.models.generation.lora_serving import VLLM_MAX_LORA_RANKS, engine_max_lora_rank

    assert VLLM_MAX_LORA_RANKS == typing.get_args(MaxLoRARanks)
    assert [engine_max_lora_rank(d) for d in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
