"""PPOMasterConfig on configs/ppo_tiny_cpu.yaml: what the critic (``value``) takes from the
policy, the learning-rate horizons with ``ppo_epochs``, and what is refused at config time
(before Ray starts), each error naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.algorithms.ppo_config import PPOMasterConfig
from nemo_rl.utils.config import ConfigError, load_typed_config
from random_checkpoints import copy_with_another_vocab_size

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "ppo_tiny_cpu.yaml"


def load(*overrides: str) -> PPOMasterConfig:
    return load_typed_config(RECIPE, list(overrides), PPOMasterConfig)


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    return str(info.value)


def test_the_critic_defaults_to_the_policy_with_the_value_head(tiny_llama_path: Path) -> None:
    cfg = load(f"policy.model_name={tiny_llama_path}", "policy.train_micro_batch_size=8")
    assert cfg.loop is cfg.ppo
    assert cfg.value.model_name == cfg.value.tokenizer.name == str(tiny_llama_path)
    assert cfg.value.train_micro_batch_size == 8
    assert cfg.value.max_total_sequence_length == cfg.policy.max_total_sequence_length == 64
    assert cfg.value.reward_model_cfg.enabled and not cfg.policy.reward_model_cfg.enabled
    assert cfg.loss_fn.reference_policy_kl_penalty == 0.0
    # its own optimizer: the recipe's critic learning rate, not the policy's
    assert cfg.value.megatron_cfg.optimizer.lr == 1e-3 != cfg.policy.megatron_cfg.optimizer.lr


def test_python_api_fills_the_critic_from_the_policy() -> None:
    cfg = PPOMasterConfig.model_validate(
        {"ppo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 1},
         "policy": {"train_global_batch_size": 8, "max_total_sequence_length": 64}}
    )
    assert (cfg.value.model_name, cfg.value.train_global_batch_size) == ("tiny-llama", 8)
    assert cfg.value.max_total_sequence_length == 64


def test_learning_rate_horizons_count_the_epochs() -> None:
    cfg = load("ppo.max_num_steps=7", "ppo.ppo_epochs=3", "ppo.policy_training_start_step=2",
               "value.train_global_batch_size=16", "value.train_micro_batch_size=16")
    # 32 samples a step: the policy one optimizer step per epoch over 5 trained steps, the
    # critic two per epoch over all 7
    assert cfg.policy.megatron_cfg.scheduler.lr_decay_iters == 5 * 3
    assert cfg.value.megatron_cfg.scheduler.lr_decay_iters == 7 * 3 * 2


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["value.reward_model_cfg.enabled=false"], "value.reward_model_cfg.enabled"),
        (["loss_fn.reference_policy_kl_penalty=0.01"], "set loss_fn.reference_policy_kl_penalty=0"),
        (["value.train_global_batch_size=12", "value.train_micro_batch_size=4"], "multiple of value.train_global_batch_size (12)"),
        (["value.max_total_sequence_length=32"], "value.max_total_sequence_length (32) must be >="),
        (["loss_fn.force_on_policy_ratio=true"], "this run takes 2"),
        (["ppo.adv_estimator.name=grpo"], "ppo.adv_estimator.name"),
        (["policy.reward_model_cfg.enabled=true"], "`nemo-rl ppo` trains a language model"),
    ],
)
def test_refused_at_config_time(overrides: list[str], expected: str) -> None:
    assert expected in refusal(*overrides)


def test_the_critic_starts_from_a_reward_model(tiny_reward_model_path: Path, tiny_llama_path: Path) -> None:
    rm = str(tiny_reward_model_path)
    cfg = load(f"policy.model_name={tiny_llama_path}", f"value.init_from_reward_model={rm}")
    assert cfg.value.model_name == cfg.value.tokenizer.name == rm
    assert cfg.policy.model_name == str(tiny_llama_path)
    assert load(f"value.init_from_reward_model={rm}", f"value.model_name={rm}").value.model_name == rm


def test_a_critic_start_that_is_not_a_reward_model_is_refused(
    tiny_reward_model_path: Path, tiny_llama_path: Path, tmp_path: Path
) -> None:
    rm = str(tiny_reward_model_path)
    assert f"value.init_from_reward_model={str(tiny_llama_path)!r} is not a reward model (LlamaForCausalLM)" in refusal(
        f"value.init_from_reward_model={tiny_llama_path}"
    )
    assert "two starting points of the critic" in refusal(
        f"value.init_from_reward_model={rm}", f"value.model_name={tiny_llama_path}"
    )
    # a reward model named as model_name would lose its trained head: pointed to the key
    assert f"set value.init_from_reward_model={rm!r} instead" in refusal(f"value.model_name={rm}")
    # the critic reads the policy's token ids
    other = copy_with_another_vocab_size(tiny_reward_model_path, tmp_path / "other_vocab")
    message = refusal(f"value.init_from_reward_model={other}")
    assert f"value.init_from_reward_model ({other}) and policy.model_name (tiny-llama) have different tokenizers or vocabulary sizes (1152 vs 1024)" in message
