"""The Megatron policy worker as PPO's critic, in one process (no Ray).

A tiny Llama worker with the scalar head (``reward_model_cfg.enabled``) is trained with
:class:`~nemo_rl.algorithms.loss.MseValueLossFn` on one fixed batch of GAE returns; then: its
per-token values are the head applied to transformers' hidden state at the previous position;
the value loss falls over a few optimizer steps; and a saved checkpoint, loaded into a fresh
critic, gives the trained values. A critic built from a reward model's folder
(``value.init_from_reward_model``) values each state at the reward model's score of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.advantage_estimators import gae_advantages
from nemo_rl.algorithms.loss import MseValueLossFn
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from tests.one_rank_worker import decoder_hidden_states, one_rank_worker

ROWS, SEQ, PROMPT = 4, 10, 3
LENGTHS = [10, 7, 9, 6]  # right-padded with 0
REWARDS = torch.tensor([1.0, -1.0, 0.5, -0.5])
STEPS = 6


def make_batch() -> BatchedDataDict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (ROWS, SEQ), generator=gen)
    mask = torch.zeros(ROWS, SEQ)
    for row, length in enumerate(LENGTHS):
        ids[row, length:] = 0
        mask[row, PROMPT:length] = 1
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor(LENGTHS),
        token_mask=mask,
        sample_mask=torch.ones(ROWS),
    )


CRITIC = {"reward_model_cfg": {"enabled": True}, "megatron_cfg": {"optimizer": {"lr": 3e-3, "min_lr": 3e-3}}}


@pytest.fixture(scope="module")
def run(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Values before training, the value losses of the steps, the trained values, the head
    before training and the values of a fresh critic loaded from the saved checkpoint."""
    ckpt = str(tmp_path_factory.mktemp("critic") / "value")
    with one_rank_worker(tiny_llama_path, ROWS, SEQ, CRITIC, seed=5) as critic:
        batch = make_batch()
        out: dict[str, Any] = {"head": critic.policy.model.module.output_layer.weight.detach().clone()}
        out["values_before"] = critic.get_values(batch)["values"]
        _, returns = gae_advantages(
            REWARDS, out["values_before"], batch["token_mask"], gamma=1.0, lam=0.95
        )
        batch["returns"], batch["values"] = returns, out["values_before"]
        loss_fn = MseValueLossFn({"scale": 1.0, "cliprange": None})
        out["steps"] = [critic.train(batch, loss_fn) for _ in range(STEPS)]
        out["values_after"] = critic.get_values(batch)["values"]
        critic.save_checkpoint(ckpt)
    with one_rank_worker(tiny_llama_path, ROWS, SEQ, CRITIC, seed=6) as fresh:
        fresh.load_checkpoint(ckpt)
        out["resumed_step"] = fresh.get_train_step()
        out["values_resumed"] = fresh.get_values(batch)["values"]
    return out


def test_values_are_the_head_on_the_previous_positions_hidden_state(
    run: dict[str, Any], tiny_llama_path: Path
) -> None:
    hidden = decoder_hidden_states(tiny_llama_path, make_batch()["input_ids"])  # [B, S, h]
    head = hidden @ run["head"][0]  # [B, S]
    values = run["values_before"]
    for row, length in enumerate(LENGTHS):
        torch.testing.assert_close(values[row, 1:length], head[row, : length - 1], rtol=0, atol=1e-5)
        assert torch.all(values[row, length:] == 0) and values[row, 0] == 0


def test_value_loss_falls_on_a_fixed_batch(run: dict[str, Any]) -> None:
    losses = [loss for step in run["steps"] for loss in step["loss"]]
    assert len(losses) == STEPS and losses[-1] < 0.5 * losses[0], losses
    assert all(step["metrics"]["vf_clipfrac"] == [0.0] for step in run["steps"])
    # the first step's extremes (reduced by min / max over its two micro-batches) are those of
    # the values before training over the loss's tokens
    mask = make_batch()["token_mask"].bool()
    before = run["values_before"][mask]
    first = run["steps"][0]["metrics"]
    assert first["values_min"][0] == pytest.approx(before.min().item(), abs=1e-6)
    assert first["values_max"][0] == pytest.approx(before.max().item(), abs=1e-6)
    # With gamma=1 the returns of a row are close to its reward; the critic moves towards them.
    err = lambda v: (v - REWARDS[:, None].expand_as(v))[mask].square().mean().item()  # noqa: E731
    assert err(run["values_after"]) < err(run["values_before"])


def test_a_resumed_critic_has_the_trained_values(run: dict[str, Any]) -> None:
    assert run["resumed_step"] == STEPS
    torch.testing.assert_close(run["values_resumed"], run["values_after"], rtol=0, atol=1e-6)


def test_a_critic_started_from_a_reward_model_values_each_state_at_the_models_score(
    tiny_reward_model_path: Path,
) -> None:
    """``value.init_from_reward_model``: the critic loads the reward model's decoder and trained
    score head, so before any update its value of the state before token t is the reward
    model's score of the sequence's first t tokens (transformers' sequence classifier)."""
    from transformers import AutoModelForSequenceClassification

    batch = make_batch()
    with one_rank_worker(tiny_reward_model_path, ROWS, SEQ, CRITIC, seed=5) as critic:
        values = critic.get_values(batch)["values"]
    rm = AutoModelForSequenceClassification.from_pretrained(
        tiny_reward_model_path, torch_dtype=torch.float32
    ).eval()
    for row, length in enumerate(LENGTHS):
        # the prefixes of 1 .. length - 1 tokens, right-padded with the pad token 0
        prefixes = torch.stack([batch["input_ids"][row] * (torch.arange(SEQ) < t) for t in range(1, length)])
        with torch.no_grad():
            scores = rm(input_ids=prefixes).logits[:, 0]
        torch.testing.assert_close(values[row, 1:length], scores, rtol=1e-5, atol=1e-5)
        assert torch.all(values[row, length:] == 0) and values[row, 0] == 0
    assert scores.abs().max() > 0.1  # a head that scores, not zeros
