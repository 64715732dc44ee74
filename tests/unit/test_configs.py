"""Every recipe in configs/ loads and validates against the schema of the command its name
starts with (``grpo_*``, ``eval_*``) (or is refused for exactly the feature it needs
that is not implemented yet); the multi-node H100 recipes' parallel layouts fit their models and
batch sizes, the launcher asks for the nodes they need, and their GPU memory plans fit an 80 GB
H100 and are the ones docs/cluster.md shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.commands import RECIPE_COMMANDS, memory_plan_of
from nemo_rl.distributed.memory_plan import GiB, MemoryPlan
from nemo_rl.launch.recipe import grpo_shape
from nemo_rl.models.generation.placement import plan_generation_layout
from nemo_rl.models.policy.parallel_layout import plan_parallel_layout
from nemo_rl.models.published_configs import PUBLISHED_CONFIGS
from nemo_rl.utils.config import load_typed_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))

MULTI_NODE = {
    "grpo_llama3.1_8b_2n8g.yaml": 2,
    "grpo_qwen2.5_32b_4n8g.yaml": 4,
    "grpo_llama3.1_8b_4n8g_noncolocated.yaml": 4,
    "grpo_qwen3_30b_a3b_2n8g.yaml": 2,
    "grpo_llama3.1_70b_16n8g.yaml": 16,
    "grpo_lora_llama3.1_70b_2n8g.yaml": 2,
}
GPU_RECIPES = sorted(p.name for p in RECIPES if "_cpu" not in p.name)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"


def test_the_multi_node_recipes_exist() -> None:
    assert set(MULTI_NODE) <= {p.name for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(recipe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CONFIGS.parent)  # recipes' data paths are relative to the repository
    cfg = load_typed_config(recipe, [], RECIPE_COMMANDS[recipe.name.split("_")[0]].schema)
    if isinstance(cfg, GRPOMasterConfig):
        samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        assert samples % cfg.policy.train_global_batch_size == 0


@pytest.mark.parametrize("name", sorted(MULTI_NODE))
def test_multi_node_recipe_layout_fits_model_and_cluster(name: str, tmp_path: Path) -> None:
    cfg = load_typed_config(CONFIGS / name, [], GRPOMasterConfig)
    assert grpo_shape(cfg).nodes == MULTI_NODE[name]
    assert cfg.cluster.gpus_per_node == 8 and cfg.policy.precision == "bfloat16"
    # The hub model is not downloaded here, so validation skipped the model checks: run them
    # on its published config.json.
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIGS[cfg.policy.model_name]))
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    layout = plan_parallel_layout(cfg.policy, tmp_path, world)
    # Tensor parallelism stays inside a node (NVLink).
    assert cfg.cluster.gpus_per_node % layout.tp == 0
    assert layout.dp * layout.tp * layout.pp * layout.cp == world
    # Expert parallelism takes its ranks out of DP x CP (megatron-core's expert grid).
    assert (layout.dp * layout.cp) % cfg.policy.megatron_cfg.expert_model_parallel_size == 0


def test_32b_recipe_generation_engines_span_four_gpus_of_one_node() -> None:
    """65.6 GB of bf16 weights do not fit one GPU next to the training state: the recipe's
    engines are TP=4, two per node, each on four GPUs of one node."""
    cfg = load_typed_config(CONFIGS / "grpo_qwen2.5_32b_4n8g.yaml", [], GRPOMasterConfig)
    tp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    layout = plan_generation_layout([cfg.cluster.gpus_per_node] * cfg.cluster.num_nodes, tp)
    assert (layout.replicas, layout.tensor_parallel_size) == (8, 4)
    assert layout.sharding_axes == {"dp": 8, "tp": 4}
    # Replica r's ranks are bundles 4r .. 4r+3: never across a node boundary (8 per node).
    for replica in range(layout.replicas):
        bundles = layout.engine_bundles(replica)
        assert list(bundles) == list(range(4 * replica, 4 * replica + 4))
        assert len({b // cfg.cluster.gpus_per_node for b in bundles}) == 1
    # Query and KV heads divide over the engine's ranks (vLLM shards them like Megatron's TP).
    arch = PUBLISHED_CONFIGS[cfg.policy.model_name]
    assert arch["num_attention_heads"] % tp == 0 and arch["num_key_value_heads"] % tp == 0


def test_the_gpu_recipes_are_the_multi_node_ones_and_the_15b() -> None:
    assert GPU_RECIPES == sorted([*MULTI_NODE, "grpo_qwen2.5_1.5b_1n8g.yaml"])


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_memory_plan_fits_an_h100_and_is_in_the_docs(name: str) -> None:
    """Validation refuses a plan over cluster.gpu_memory_gb; here the plan exists (the model's
    shape is known without a download), is against 80 GiB, and docs/cluster.md shows it as
    the code computes it (regenerate the table from ``plan.markdown()`` when this fails)."""
    cfg = load_typed_config(CONFIGS / name, [], GRPOMasterConfig)
    plan = memory_plan_of(cfg)
    assert isinstance(plan, MemoryPlan)
    assert plan.gpu_bytes == 80 * GiB and plan.peak().total <= plan.gpu_bytes
    plan.check()
    section = DOCS.read_text().split("## Memory plan", 1)[1]
    assert f"### `{name}`\n\n{plan.markdown()}\n" in section, plan.markdown()


def test_lora_70b_recipe_fits_two_nodes_only_because_the_base_is_frozen() -> None:
    """The plan counts gradients and optimizer state of the adapters only: the LoRA recipe fits
    2 nodes, the same recipe training every weight does not (gradients 32.9 GiB, Adam 49 GiB)."""
    recipe = CONFIGS / "grpo_lora_llama3.1_70b_2n8g.yaml"
    lora = memory_plan_of(load_typed_config(recipe, [], GRPOMasterConfig))
    assert isinstance(lora, MemoryPlan)
    assert lora.term("training", "gradient buffer").nbytes < GiB
    full_cfg = load_typed_config(
        recipe, ["policy.megatron_cfg.peft.enabled=false", "cluster.gpu_memory_gb=1000"],
        GRPOMasterConfig,
    )
    full = memory_plan_of(full_cfg)
    assert isinstance(full, MemoryPlan)
    assert full.term("training", "gradient buffer").nbytes > 32 * GiB
    assert full.phase("training").total > 80 * GiB >= lora.peak().total
