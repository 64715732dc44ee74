"""What the GRPO step adds to its training batch after the logprob passes
(:func:`~nemo_rl.algorithms.grpo_step.train_fields.train_fields`), against hand-derived values:
``loss_fn.use_kl_in_reward`` gives REINFORCE++'s per-token advantages with the KL in the
reward (NeMo RL's semantics), and ``positive_example_nll_weight`` puts the rewards in the batch
(both stores) so that the loss adds VAPO's NLL of the positive samples."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.grpo_config import GRPOConfig, GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.train_fields import (
    RewardComponentsError,
    advantage_fields,
    train_fields,
)
from nemo_rl.algorithms.loss import ClippedPGLossFn
from nemo_rl.data_plane import InProcessDataPlane
from nemo_rl.data_plane.columns import write_columns
from nemo_rl.experience.sync_rollout_actor import store_training_fields
from nemo_rl.experience.grouped_rollouts import RolloutCarry, training_fields
from nemo_rl.models.policy.workers.megatron.data_plane_io import fetch_batch
from nemo_rl.utils.errors import InputError

from .test_batch_stores import PAD, in_memory_store, rollout_batch

# one group of two: 2 prompt tokens each; responses of 2 and 1 tokens, rewards 1 and 0
ROWS = [(2, 2, 1.0), (2, 1, 0.0)]


def step_batch():
    """The in-memory batch after the logprob passes: token_mask is 1 at (0, 2), (0, 3), (1, 2);
    k1 KL ``prev - ref`` there: 0.2, 0.4 and 0.1."""
    rollout, group_ids = rollout_batch(ROWS)
    batch = training_fields(rollout, PAD)
    assert batch["token_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    batch["prev_logprobs"] = torch.tensor([[0.0, -1.0, -0.5, -0.7], [0.0, -2.0, -0.3, 0.0]])
    batch["reference_policy_logprobs"] = batch["prev_logprobs"] - torch.tensor(
        [[0.0, 0.9, 0.2, 0.4], [0.0, 0.9, 0.1, 0.0]]  # off-mask entries must not count
    )
    return batch, RolloutCarry.from_rollout(rollout, group_ids, {}, sampling_step=0)


def config(**loss_fn) -> GRPOMasterConfig:
    return GRPOMasterConfig.model_validate(
        {
            "grpo": {"adv_estimator": {"name": "reinforce_plus_plus", "minus_baseline": True}},
            "loss_fn": loss_fn,
        }
    )


def test_kl_in_reward_gives_reinforce_plus_plus_per_token_advantages() -> None:
    batch, carry = step_batch()
    cfg = config(use_kl_in_reward=True, reference_policy_kl_penalty=0.5, reference_policy_kl_type="k1")
    fields, _ = train_fields(carry, cfg, batch)
    assert "rewards" not in fields
    out = in_memory_store().add_fields(batch, fields)
    # rewards minus the group mean (0.5): +0.5, -0.5; minus 0.5 * KL per token:
    # 0.4, 0.3 | -0.55; mean 0.05; deviations 0.35, 0.25 | -0.6; population variance 0.545 / 3
    scale = math.sqrt(0.545 / 3)
    want = torch.tensor([[0, 0, 0.35 / scale, 0.25 / scale], [0, 0, -0.6 / scale, 0]])
    torch.testing.assert_close(out["advantages"], want, rtol=0, atol=1e-6)


def test_without_kl_in_reward_advantages_stay_per_sample() -> None:
    batch, carry = step_batch()
    fields, _ = train_fields(carry, config(reference_policy_kl_penalty=0.5), batch)
    assert fields["advantages"].shape == (2,)
    # +-0.5 on 3 tokens: mean 1/6, deviations 1/3, 1/3 | -2/3, variance 2/9
    torch.testing.assert_close(fields["advantages"], torch.tensor([1 / 3, -2 / 3]) / math.sqrt(2 / 9))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"grpo": {"adv_estimator": {"name": "grpo"}}}, "grpo.adv_estimator.name=reinforce_plus_plus"),
        ({"loss_fn": {"use_kl_in_reward": True, "force_on_policy_ratio": True}, "policy": {"train_global_batch_size": 32}}, "force_on_policy_ratio=false"),
        ({"data_plane": {"enabled": True}}, "data_plane.enabled=false"),
    ],
)
def test_kl_in_reward_refuses_what_cannot_carry_it(change: dict, message: str) -> None:
    raw = {
        "grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}},
        "loss_fn": {"use_kl_in_reward": True},
    }
    raw.update(change)
    raw["loss_fn"]["use_kl_in_reward"] = True
    with pytest.raises(ValueError, match=rf"loss_fn.use_kl_in_reward=true needs .*{message}"):
        GRPOMasterConfig.model_validate(raw)


def test_vapo_rewards_reach_the_loss_through_both_stores() -> None:
    batch, carry = step_batch()
    cfg = config(positive_example_nll_weight=0.1, reference_policy_kl_penalty=0.0)
    fields, _ = train_fields(carry, cfg, batch)
    assert torch.equal(fields["rewards"], torch.tensor([1.0, 0.0]))
    out = in_memory_store().add_fields(batch, fields)

    plane = InProcessDataPlane()
    plane.register_partition("train")
    rollout_fields = training_fields(rollout_batch(ROWS)[0], PAD)
    meta = store_training_fields(plane, "train", ["s0", "s1"], rollout_fields, PAD)
    fetched = fetch_batch(plane, write_columns(plane, meta, fields))
    assert torch.equal(fetched["rewards"], fields["rewards"])

    # the loss's VAPO term: 0.1 * mean(-lp) over the positive sample's tokens (0, 2), (0, 3)
    lp = out["prev_logprobs"].double()
    data = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    seqs, toks = torch.tensor(2.0), out["token_mask"].sum()
    with_nll, metrics = ClippedPGLossFn(cfg.loss_fn)(data, seqs, toks, next_token_logprobs=lp)
    without, _ = ClippedPGLossFn(config(reference_policy_kl_penalty=0.0).loss_fn)(data, seqs, toks, next_token_logprobs=lp)
    assert metrics["positive_nll_loss"] == pytest.approx((0.5 + 0.7) / 2)
    assert with_nll.item() - without.item() == pytest.approx(0.1 * (0.5 + 0.7) / 2, rel=1e-6)  # float32 logprobs


def gdpo_carry(correctness: list[float], fmt: list[float], total: list[float] | None = None) -> RolloutCarry:
    """A carry of len(correctness) samples in groups of two whose rollout holds the named
    rewards ``reward/correctness`` and ``reward/format`` (total: their sum unless given)."""
    total = total or [c + f for c, f in zip(correctness, fmt)]
    rollout, group_ids = rollout_batch([(2, 1, t) for t in total])
    rollout["reward/correctness"] = torch.tensor(correctness)
    rollout["reward/format"] = torch.tensor(fmt)
    return RolloutCarry.from_rollout(rollout, group_ids, {}, sampling_step=0)


def gdpo_config(**estimator) -> GRPOConfig:
    """The ``grpo`` section with GDPO (a whole recipe would refuse gdpo on the default math
    task at config time)."""
    return GRPOConfig.model_validate({"adv_estimator": {"name": "gdpo", **estimator}})


def test_gdpo_advantages_of_the_carry_and_named_reward_metrics() -> None:
    # groups (0, 1) and (2, 3): (1, 0) vs (0, 1) has one total, so GRPO gives both 0; and
    # (1, 1) vs (0, 0). With the group mean, every component is +-1/2 over the group's std
    # 1/sqrt(2) (+ 1e-6): +-h; weights 1 and 2 (sorted names: correctness, format).
    carry = gdpo_carry([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0])
    cfg = gdpo_config(reward_weights=[1.0, 2.0], use_leave_one_out_baseline=False)
    fields, metrics = advantage_fields(carry, cfg)
    h = 0.5 / (1 / math.sqrt(2) + 1e-6)
    combined = [h - 2 * h, -h + 2 * h, h + 2 * h, -h - 2 * h]  # mean 0
    std = math.sqrt(sum(c**2 for c in combined) / 3)
    assert fields["advantages"].tolist() == pytest.approx([c / std for c in combined], rel=1e-6)
    assert fields["advantages"][0] != fields["advantages"][1]
    assert metrics["reward/correctness"] == 0.5 and metrics["reward/format"] == 0.5
    # the named rewards follow the carry's rows through select and concat (0 where absent)
    two = RolloutCarry.concat([carry.select([3, 0]), gdpo_carry([1.0, 1.0], [0.0, 0.0])], {})
    assert two.reward_components["reward/format"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert two.reward_components["reward/correctness"].tolist() == [0.0, 1.0, 1.0, 1.0]
    single = RolloutCarry.from_rollout(rollout_batch([(2, 1, 1.0)] * 2)[0], torch.zeros(2), {}, 0)
    mixed = RolloutCarry.concat([carry.select([0, 1]), single], {})
    assert mixed.reward_components["reward/format"].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_gdpo_refuses_rewards_that_do_not_fit_it() -> None:
    assert issubclass(RewardComponentsError, InputError)  # one line, exit 2
    single = RolloutCarry.from_rollout(*rollout_batch([(2, 1, 1.0), (2, 1, 0.0)]), {}, 0)
    with pytest.raises(RewardComponentsError, match="returned one reward; return"):
        advantage_fields(single, gdpo_config())
    # a sample whose environment returned a single reward (total 1, no named rewards)
    unsplit = gdpo_carry([1.0, 0.0], [0.0, 0.0], total=[1.0, 1.0])
    with pytest.raises(RewardComponentsError, match=r"1 of this step's samples .* \(sample 1: 1 vs 0\)"):
        advantage_fields(unsplit, gdpo_config())
    with pytest.raises(RewardComponentsError, match="has 3 weights but the environments return 2"):
        advantage_fields(gdpo_carry([1.0, 0.0], [0.0, 1.0]), gdpo_config(reward_weights=[1.0, 1.0, 1.0]))
