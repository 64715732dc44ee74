"""The Megatron policy as a Bradley-Terry reward model, in one process (no Ray).

One reward model is built (tiny Llama, ``reward_model_cfg.enabled``) and trained one step on
preference pairs; then: its rewards are the score head applied to transformers' last hidden
state at each row's last real token; its checkpoint exports (``nemo-rl export``) as an HF
``LlamaForSequenceClassification`` whose scores equal the Megatron rewards; and the head
changed in the step (it trains).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.loss import PreferenceLossFn
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.export import export_checkpoint
from nemo_rl.models.policy.workers.megatron.checkpointing import save_training_checkpoint
from nemo_rl.models.policy.workers.megatron.model_setup import PolicyModel, setup_policy_model
from nemo_rl.models.policy.workers.megatron.train_step import compute_rewards, iterate_steps
from tests.one_rank_worker import decoder_hidden_states, one_rank_env

PAIRS, SEQ = 2, 12
LENGTHS = [12, 7, 9, 5]  # rows: chosen, rejected, chosen, rejected (right-padded with 0)


def make_batch() -> BatchedDataDict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (2 * PAIRS, SEQ), generator=gen)
    for row, length in enumerate(LENGTHS):
        ids[row, length:] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor(LENGTHS),
        token_mask=torch.ones(2 * PAIRS, SEQ),
        sample_mask=torch.ones(2 * PAIRS),
    )


@pytest.fixture(scope="module")
def run(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Rewards before and after one step, the head before and after, and the exported folder."""
    config = PolicyConfig(
        model_name=str(tiny_llama_path),
        train_global_batch_size=PAIRS,
        train_micro_batch_size=1,
        max_total_sequence_length=SEQ,
        precision="float32",
        reward_model_cfg={"enabled": True},
        megatron_cfg={"optimizer": {"lr": 1e-2, "min_lr": 1e-2}},
    )
    with one_rank_env():
        policy: PolicyModel = setup_policy_model(config, str(tiny_llama_path), seed=3)
        head = policy.model.module.output_layer.weight
        out: dict[str, Any] = {"head_before": head.detach().clone()}
        out["rewards_before"] = compute_rewards(policy, make_batch(), 2, False)
        (out["step"],) = iterate_steps(policy, make_batch(), PreferenceLossFn(), 4, 2, False, False)
        out["head_after"] = head.detach().clone()
        out["rewards_after"] = compute_rewards(policy, make_batch(), 4, False)
        tmp = tmp_path_factory.mktemp("rm")
        save_training_checkpoint(policy, tmp / "policy", 1, assets_dir=tiny_llama_path)
        export_checkpoint(tmp / "policy", tmp / "hf")
        out["hf"] = tmp / "hf"
        yield out


def test_reward_is_the_head_on_the_last_real_tokens_hidden_state(
    run: dict[str, Any], tiny_llama_path: Path
) -> None:
    hidden = decoder_hidden_states(tiny_llama_path, make_batch()["input_ids"])  # [B, S, h]
    last = hidden[torch.arange(len(LENGTHS)), torch.tensor(LENGTHS) - 1]
    expected = last @ run["head_before"][0]
    torch.testing.assert_close(run["rewards_before"], expected, rtol=0, atol=1e-5)
    assert run["head_before"].std().item() == pytest.approx(0.02, rel=0.3)  # initializer_range


def test_one_step_trains_the_head_and_the_rewards_move_apart(run: dict[str, Any]) -> None:
    assert run["step"]["metrics"]["num_valid_samples"] == 4
    assert not torch.equal(run["head_before"], run["head_after"])
    before, after = run["rewards_before"], run["rewards_after"]
    margin = lambda r: (r[0::2] - r[1::2]).mean().item()  # noqa: E731
    assert margin(after) > margin(before)


def test_export_is_an_hf_sequence_classifier_with_the_same_scores(run: dict[str, Any]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    config = json.loads((run["hf"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["pad_token_id"] == 0 and len(config["id2label"]) == 1
    tensors = load_file(run["hf"] / "model.safetensors")
    assert "lm_head.weight" not in tensors and tensors["score.weight"].shape == (1, 128)
    model = AutoModelForSequenceClassification.from_pretrained(run["hf"]).eval()
    assert model.config.num_labels == 1
    batch = make_batch()
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"]).logits[:, 0]  # last non-pad token
    torch.testing.assert_close(scores, run["rewards_after"], rtol=0, atol=1e-5)
