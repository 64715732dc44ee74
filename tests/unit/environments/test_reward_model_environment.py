"""RewardModelEnvironment: its rewards are the reward model's scores of each conversation alone
(batched with padding or not), and a folder that is not a reward model is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_rl.data.conversations import conversation_datum
from nemo_rl.data.processors import prompt_only_processor
from nemo_rl.environments.config import EnvConfigs
from nemo_rl.environments.reward_model_environment import RewardModelEnvironment
from nemo_rl.utils.config import ConfigError, validate_config

CLS = "nemo_rl.environments.reward_model_environment:RewardModelEnvironment"

ANSWERS = ["\\boxed{7}", "\\boxed{12345}", "I think it is \\boxed{6}, or maybe 8", "7"]


def test_rewards_are_the_models_scores_of_each_conversation(tiny_reward_model_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    env = RewardModelEnvironment(str(tiny_reward_model_path), batch_size=3)  # two batches, padded
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_path)
    logs = [
        conversation_datum(
            [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": a}],
            tokenizer, 256, i, "test",
        )["message_log"]
        for i, a in enumerate(ANSWERS)
    ]
    result = env.step(logs, [{}] * len(logs))
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_path).eval()
    expected = []
    for log in logs:
        ids = torch.cat([m["token_ids"] for m in log])[None]  # one row, no padding
        with torch.no_grad():
            expected.append(float(model(input_ids=ids).logits[0, 0]))
    torch.testing.assert_close(result.rewards, torch.tensor(expected), rtol=0, atol=1e-5)
    assert result.rewards.dtype == torch.float32 and bool(result.terminateds.all())
    assert len(set(result.rewards.tolist())) == len(ANSWERS)  # the scores tell them apart


def test_refuses_a_folder_that_is_not_a_reward_model(tiny_reward_model_path: Path, tiny_llama_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"env.rm.model_path=.*not a reward model \(LlamaForCausalLM\)"):
        RewardModelEnvironment.check_arguments("env.rm", model_path=str(tiny_llama_path))
    with pytest.raises(ValueError, match=r"env.rm.model_path=.*no config.json"):
        RewardModelEnvironment.check_arguments("env.rm", model_path=str(tmp_path))
    config = json.loads((tiny_reward_model_path / "config.json").read_text())
    del config["pad_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pad_token_id"):
        RewardModelEnvironment.check_arguments("env.rm", model_path=str(tmp_path))
    RewardModelEnvironment.check_arguments("env.rm", model_path=str(tiny_reward_model_path))


def test_a_grpo_env_section_names_it_as_a_plugin(tiny_reward_model_path: Path, tiny_llama_path: Path) -> None:
    """The section documented in docs/algorithms.md validates; a causal LM is refused there."""
    section = {"cls": CLS, "model_path": str(tiny_reward_model_path), "processor": "prompt"}
    spec = validate_config({"rm": section}, EnvConfigs, source="env").specs()["rm"]
    assert spec.cls is RewardModelEnvironment and spec.processor is prompt_only_processor
    assert spec.kwargs == {"model_path": str(tiny_reward_model_path)}
    with pytest.raises(ConfigError, match=r"env.rm.model_path=.*LlamaForCausalLM"):
        validate_config({"rm": {**section, "model_path": str(tiny_llama_path)}}, EnvConfigs, source="env")
