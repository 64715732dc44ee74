"""Where the memory plan gets a model's shape (its own config.json, the published values of the
shipped recipes' hub models, or nowhere) and that the shape counts the model's parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from megatron_bridge import BridgeConfig
from nemo_rl.distributed.memory_plan import (
    GRADIENTS,
    OPTIMIZER,
    PARAMETERS,
    TRAINING,
    MemoryPlan,
    NoMemoryPlan,
)
from nemo_rl.models.policy.config import MegatronConfig, PeftConfig, PolicyConfig
from nemo_rl.models.policy.gpu_memory import model_shape, plan_policy_memory
from nemo_rl.models.published_configs import PUBLISHED_CONFIGS
from nemo_rl.models.tiny import build_tiny_model

# Parameter counts of the hub models' own checkpoints (their model cards); the plan leaves out
# norms and biases, < 0.1 % of them.
PUBLISHED_PARAMETERS = {
    "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "meta-llama/Llama-3.1-70B-Instruct": 70_553_706_496,
    "Qwen/Qwen2.5-32B-Instruct": 32_763_876_352,
    "Qwen/Qwen3-30B-A3B": 30_532_122_624,
}


def matrix_elements(checkpoint: Path) -> int:
    """Elements of the checkpoint's 2-D tensors (every projection, embedding, head, router;
    not the norms' and biases' vectors)."""
    total = 0
    for file in checkpoint.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2:
                    total += shape[0] * shape[1]
    return total


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_shape_of_a_local_checkpoint_counts_its_matrices(family: str) -> None:
    path = build_tiny_model(family)
    shape = model_shape(BridgeConfig.from_hf(path))
    assert shape.total_params == matrix_elements(path)
    if family == "qwen3_moe":
        assert shape.num_moe_layers == shape.num_layers and shape.num_experts > 0


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_shapes_match_the_models_parameter_counts(name: str) -> None:
    shape = model_shape(BridgeConfig(dict(PUBLISHED_CONFIGS[name])))
    assert abs(shape.total_params / PUBLISHED_PARAMETERS[name] - 1) < 1e-3


def test_a_local_config_json_comes_first(tiny_llama_path: Path) -> None:
    policy = PolicyConfig(model_name=str(tiny_llama_path), precision="bfloat16")
    plan = plan_policy_memory(policy, world_size=1, gpu_memory_gb=80, with_generation=True)
    assert isinstance(plan, MemoryPlan)
    assert plan.model == f"{tiny_llama_path} (shape from its config.json)"
    shape = model_shape(BridgeConfig.from_hf(tiny_llama_path))
    # TP 1: every parameter on the GPU, 2 B each (the vocabulary already a multiple of 128)
    assert plan.term(TRAINING, PARAMETERS).nbytes == shape.total_params * 2


def test_a_shipped_hub_model_uses_its_published_values() -> None:
    policy = PolicyConfig(model_name="Qwen/Qwen2.5-1.5B-Instruct", precision="bfloat16")
    plan = plan_policy_memory(policy, world_size=8, gpu_memory_gb=80, with_generation=False)
    assert isinstance(plan, MemoryPlan)
    assert "published config.json values" in plan.model


def test_an_unknown_hub_model_has_no_plan_and_says_why() -> None:
    policy = PolicyConfig(model_name="some-org/not-cached-here")
    plan = plan_policy_memory(policy, world_size=8, gpu_memory_gb=80, with_generation=True)
    assert isinstance(plan, NoMemoryPlan)
    assert "the shape of 'some-org/not-cached-here' is unknown here" in plan.reason
    assert "huggingface-cli download some-org/not-cached-here config.json" in plan.reason
    plan.check()  # nothing to refuse


def test_lora_plan_counts_the_adapters_of_the_checkpoints_projections(tiny_llama_path: Path) -> None:
    """Rank r on every projection of a TP=1 model: r x (in + out) per adapted linear, q/k/v
    (and gate/up) fused into one adapter, so r x (h + q + k + v) for the attention's input."""
    r = 4
    peft = PeftConfig(enabled=True, dim=r)
    policy = PolicyConfig(
        model_name=str(tiny_llama_path), precision="bfloat16", megatron_cfg=MegatronConfig(peft=peft)
    )
    plan = plan_policy_memory(policy, world_size=1, gpu_memory_gb=80, with_generation=True)
    assert isinstance(plan, MemoryPlan)
    adapters = 0
    for file in tiny_llama_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    layers = {n.split(".")[2] for n in shapes if ".layers." in n}
    for i in layers:
        p = f"model.layers.{i}."
        out = lambda m: shapes[p + m + ".weight"][0]  # noqa: E731
        inp = lambda m: shapes[p + m + ".weight"][1]  # noqa: E731
        qkv = out("self_attn.q_proj") + out("self_attn.k_proj") + out("self_attn.v_proj")
        adapters += r * (inp("self_attn.q_proj") + qkv)
        adapters += r * (inp("self_attn.o_proj") + out("self_attn.o_proj"))
        adapters += r * (inp("mlp.gate_proj") + out("mlp.gate_proj") + out("mlp.up_proj"))
        adapters += r * (inp("mlp.down_proj") + out("mlp.down_proj"))
    shape = model_shape(BridgeConfig.from_hf(tiny_llama_path))
    assert plan.term(TRAINING, PARAMETERS).nbytes == (shape.total_params + adapters) * 2
    assert plan.term(TRAINING, GRADIENTS).nbytes == adapters * 4
    assert plan.term(TRAINING, OPTIMIZER).nbytes == adapters * 12
