"""What the SFT, DPO and RM recipes refuse at config time (before Ray starts), each error naming the
field and the fix, and what they derive."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.algorithms.distillation_config import DistillationMasterConfig
from nemo_rl.algorithms.dpo_config import DPOMasterConfig
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.rm_config import RMMasterConfig
from nemo_rl.algorithms.sft_config import SFTMasterConfig
from nemo_rl.commands import RECIPE_COMMANDS
from nemo_rl.utils.config import ConfigError, load_typed_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
RECIPES = {
    "sft": (CONFIGS / "sft_tiny_cpu.yaml", SFTMasterConfig),
    "dpo": (CONFIGS / "dpo_tiny_cpu.yaml", DPOMasterConfig),
    "rm": (CONFIGS / "rm_tiny_cpu.yaml", RMMasterConfig),
    "grpo": (CONFIGS / "grpo_tiny_cpu.yaml", GRPOMasterConfig),
    "distillation": (CONFIGS / "distillation_tiny_cpu.yaml", DistillationMasterConfig),
}


def refusal(command: str, *overrides: str) -> str:
    path, schema = RECIPES[command]
    with pytest.raises(ConfigError) as info:
        load_typed_config(path, list(overrides), schema)
    return str(info.value)


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_recipes_load_and_are_registered(command: str) -> None:
    path, schema = RECIPES[command]
    cfg = load_typed_config(path, [], schema)
    assert RECIPE_COMMANDS[command].schema is schema
    # the learning-rate horizon is the run's step count
    assert cfg.policy.megatron_cfg.scheduler.lr_decay_iters == getattr(cfg, command).max_num_steps


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_missing_data_file_names_the_field(command: str) -> None:
    message = refusal(command, "data.train_path=/nonexistent/train.jsonl")
    assert "data.train_path: file '/nonexistent/train.jsonl' does not exist" in message


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_validation_batch_must_split_into_micro_batches(command: str) -> None:
    message = refusal(command, f"{command}.val_micro_batch_size=48")
    assert f"{command}.val_global_batch_size (64)" in message
    assert f"{command}.val_micro_batch_size (48)" in message
    # no validation: nothing to split
    path, schema = RECIPES[command]
    load_typed_config(
        path,
        [f"{command}.val_micro_batch_size=48", f"{command}.val_period=0",
         f"{command}.val_at_start=false", "checkpointing.metric_name=train_loss"],
        schema,
    )


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_checkpoint_metric_must_be_one_the_loop_records(command: str) -> None:
    message = refusal(command, "checkpointing.metric_name=loss")
    assert "val_loss" in message and "train_loss" in message
    off = refusal(command, f"{command}.val_period=0", f"{command}.val_at_start=false")
    assert f"validation is off ({command}.val_period=0" in off


def test_dpo_refuses_micro_batches_that_split_pairs() -> None:
    message = refusal("dpo", "policy.sequence_packing.enabled=true")
    assert "policy.sequence_packing.enabled is not supported by DPO" in message


def test_dpo_section_holds_nemo_rl_loss_keys() -> None:
    path, schema = RECIPES["dpo"]
    cfg = load_typed_config(
        path, ["dpo.sft_loss_weight=0.5", "dpo.preference_average_log_probs=true"], schema
    )
    assert cfg.dpo.sft_loss_weight == 0.5 and cfg.dpo.preference_average_log_probs
    assert cfg.dpo.reference_policy_kl_penalty == 0.1


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_preference_recipes_refuse_micro_batches_that_split_pairs(command: str) -> None:
    message = refusal(command, "policy.dynamic_batching.enabled=true")
    assert f"policy.dynamic_batching.enabled is not supported by {command.upper()}" in message


def test_only_rm_trains_a_reward_head() -> None:
    path, schema = RECIPES["rm"]
    assert load_typed_config(path, [], schema).policy.reward_model_cfg.enabled
    message = refusal("rm", "policy.reward_model_cfg.enabled=false")
    assert "policy.reward_model_cfg.enabled=false but `nemo-rl rm` trains a reward model: set it to true" in message
    for command in ("sft", "dpo", "grpo", "distillation"):
        message = refusal(command, "policy.reward_model_cfg.enabled=true")
        assert f"policy.reward_model_cfg.enabled=true but `nemo-rl {command}`" in message
        assert "set it to false" in message
    assert "bradley_terry" in refusal("rm", "policy.reward_model_cfg.reward_model_type=pairwise")
