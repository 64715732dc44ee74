"""The two batch stores hand the policy the same training batch, and it is GRPO's.

A rollout is flattened once (``training_fields``); the step's per-sample fields come from the
carry (``advantage_fields``). The in-memory store's batch after ``add_fields`` and the batch a
policy worker fetches from the data plane (stored as the rollout actor stores it) must both
equal the reference: advantages of ``grpo_advantages`` on the token mask, the loss mask of the
overlong filter (same tensors, dtypes, shapes). Dynamic sampling's ``keep`` gives the batch a
rollout of only the kept rows would have given.
"""

from __future__ import annotations

import pytest
import torch

from nemo_rl.algorithms.advantage_estimators import (
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.train_fields import advantage_fields
from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.data_plane import InProcessDataPlane
from nemo_rl.data_plane.columns import write_columns
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.sync_rollout_actor import store_training_fields
from nemo_rl.experience.grouped_rollouts import RolloutCarry, RolloutRunner, training_fields
from nemo_rl.models.policy.workers.megatron.data_plane_io import fetch_batch

PAD = 7
# (prompt tokens, response tokens, reward) per row; rows 2g, 2g+1 form group g
ROWS = [(3, 4, 1.0), (3, 2, 0.0), (5, 6, 0.5), (5, 6, 0.5), (2, 1, 0.0), (2, 7, 1.0)]


def rollout_batch(rows=ROWS, seed: int = 1) -> tuple[BatchedDataDict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logs = []
    for prompt, response, _ in rows:
        logs.append(
            [
                {
                    "role": "user",
                    "content": "",
                    "token_ids": torch.randint(10, 50, (prompt,), generator=g),
                },
                {
                    "role": "assistant",
                    "content": "",
                    "token_ids": torch.randint(10, 50, (response,), generator=g),
                    "generation_logprobs": -torch.rand(response, generator=g),
                },
            ]
        )
    n = len(rows)
    rollout = BatchedDataDict(
        message_log=logs,
        total_reward=torch.tensor([r for _, _, r in rows]),
        loss_multiplier=torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0][:n]),
        truncated=torch.tensor([False, False, False, False, True, False][:n]),
        response_truncated=torch.tensor([False, True, False, False, True, False][:n]),
        env_error=[None, None, None, "environment 'math': KeyError('x')", None, None][:n],
    )
    return rollout, torch.arange(n) // 2


def in_memory_store() -> InMemoryBatchStore:
    runner = RolloutRunner(
        generation=None, tokenizer=None, task_to_env={}, max_seq_len=64, max_rollout_turns=1,
        pad_token_id=PAD,
    )
    return InMemoryBatchStore(runner, policy=None)


def reference_train_data(
    rollout: BatchedDataDict, group_ids: torch.Tensor, cfg: GRPOConfig
) -> dict[str, torch.Tensor]:
    """GRPO's training batch computed directly from the rollout, on the token mask."""
    flat = message_logs_to_flat(rollout["message_log"], PAD)
    overlong = rollout["truncated"] | rollout["response_truncated"]
    sample_mask = rollout["loss_multiplier"].float()
    if cfg.overlong_filtering:
        sample_mask = sample_mask * (~overlong).float()
    return {
        "input_ids": flat["input_ids"],
        "input_lengths": flat["input_lengths"],
        "token_mask": flat["token_mask"].float(),
        "generation_logprobs": flat["generation_logprobs"].float(),
        "sample_mask": sample_mask,
        "advantages": grpo_advantages(
            rollout["total_reward"].float(),
            group_ids,
            flat["token_mask"],
            use_leave_one_out_baseline=cfg.use_leave_one_out_baseline,
            normalize_rewards=cfg.normalize_rewards,
        ),
    }


def assert_same_batch(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(
    "loo, normalize, overlong", [(True, True, True), (False, True, False), (False, False, True)]
)
def test_both_stores_give_the_reference_train_data(
    loo: bool, normalize: bool, overlong: bool
) -> None:
    cfg = GRPOConfig(
        num_generations_per_prompt=2,
        use_leave_one_out_baseline=loo,
        normalize_rewards=normalize,
        overlong_filtering=overlong,
    )
    rollout, group_ids = rollout_batch()
    want = reference_train_data(rollout, group_ids, cfg)
    fields = training_fields(rollout, PAD)
    carry = RolloutCarry.from_rollout(rollout, group_ids, {}, sampling_step=0)
    per_sample, metrics = advantage_fields(carry, cfg)
    assert {name: t.shape for name, t in per_sample.items()} == {
        "advantages": (len(ROWS),), "sample_mask": (len(ROWS),)
    }
    # groups 0 and 2 differ in reward, group 1 does not; rows 1 and 4 were cut
    assert metrics == {
        "fraction_of_zero_std_groups": pytest.approx(1 / 3),
        **({"overlong_filtered_fraction": pytest.approx(2 / 6)} if overlong else {}),
    }

    assert_same_batch(in_memory_store().add_fields(fields, per_sample), want)

    plane = InProcessDataPlane()
    plane.register_partition("train")
    meta = store_training_fields(plane, "train", [f"s{i}" for i in range(len(ROWS))], fields, PAD)
    assert_same_batch(fetch_batch(plane, write_columns(plane, meta, per_sample)), want)
    assert (want["advantages"] != 0).any()  # the comparison covers real advantages


def test_in_memory_keep_equals_a_rollout_of_the_kept_rows() -> None:
    first, _ = rollout_batch(ROWS[:4], seed=2)  # longest row 11 tokens
    second, _ = rollout_batch([(2, 1, 0.0), (9, 9, 1.0)], seed=3)  # 18 tokens
    batches = [training_fields(first, PAD), training_fields(second, PAD)]
    store = in_memory_store()
    # row 1 of the first batch (5 tokens) and row 0 of the second (3): the rest is longer
    got = store.keep(batches, torch.tensor([1, 4]))
    kept = BatchedDataDict.from_batches([first, second]).select_indices([1, 4])
    assert_same_batch(got, training_fields(kept, PAD))
    assert got["input_ids"].shape == (2, 5)
    assert store.keep(batches, torch.tensor([], dtype=torch.long))["input_ids"].shape == (0, 1)


def test_carry_select_and_concat_keep_rows_aligned() -> None:
    rollout, group_ids = rollout_batch()
    carry = RolloutCarry.from_rollout(rollout, group_ids, {"reward_mean": 0.5}, sampling_step=3)
    assert carry.first_env_error == "environment 'math': KeyError('x')"
    picked = carry.select(torch.tensor([5, 0]))
    assert picked.group_ids.tolist() == [2, 0] and picked.rewards.tolist() == [1.0, 1.0]
    assert picked.truncated.tolist() == [False, False] and picked.sampling_step == 3
    clean = RolloutCarry.from_rollout(*rollout_batch(ROWS[:2]), {}, sampling_step=4)
    assert clean.first_env_error is None
    joined = RolloutCarry.concat([clean, picked, carry.select([4])], {"reward_mean": 0.25})
    assert joined.size == 5 and joined.truncated.tolist() == [False, False, False, False, True]
    assert joined.metrics == {"reward_mean": 0.25}
    # the step's first error, though its sample was not kept
    assert joined.first_env_error == "environment 'math': KeyError('x')"


@pytest.mark.parametrize("minus_baseline", [True, False])
def test_reinforce_plus_plus_fields_equal_the_estimator_on_the_loss_tokens(minus_baseline):
    """NeMo RL whitens over ``token_mask * sample_mask``; the per-sample values the step
    stores, put on each sample's tokens, are that estimator's advantages."""
    cfg = GRPOConfig(
        num_generations_per_prompt=2,
        overlong_filtering=True,
        adv_estimator={"name": "reinforce_plus_plus", "minus_baseline": minus_baseline},
    )
    rollout, group_ids = rollout_batch()
    carry = RolloutCarry.from_rollout(rollout, group_ids, {}, sampling_step=0)
    per_sample, _ = advantage_fields(carry, cfg)
    token_mask = message_logs_to_flat(rollout["message_log"], PAD)["token_mask"].float()
    want = reinforce_plus_plus_advantages(
        rollout["total_reward"].float(),
        token_mask * per_sample["sample_mask"][:, None],
        group_ids=group_ids if minus_baseline else None,
    )
    got = per_sample["advantages"][:, None] * token_mask
    torch.testing.assert_close(got * per_sample["sample_mask"][:, None], want)
    assert (want != 0).any()


def test_rloo_fields_are_leave_one_out_without_normalisation():
    cfg = GRPOConfig(num_generations_per_prompt=2, adv_estimator={"name": "rloo"})
    assert (cfg.adv_estimator.normalize_rewards, cfg.adv_estimator.use_leave_one_out_baseline) == (
        False, True
    )
    rollout, group_ids = rollout_batch()
    carry = RolloutCarry.from_rollout(rollout, group_ids, {}, sampling_step=0)
    per_sample, _ = advantage_fields(carry, cfg)
    mask = torch.ones(len(ROWS), 1)
    want = rloo_advantages(rollout["total_reward"].float(), group_ids, mask)[:, 0]
    assert torch.equal(per_sample["advantages"], want)
    assert per_sample["advantages"].tolist()[:2] == [1.0, -1.0]


def test_estimator_settings_resolve_from_nemo_rls_two_places_and_contradictions_are_refused():
    # adv_estimator's grpo settings default to the top-level keys
    cfg = GRPOConfig(normalize_rewards=False, use_leave_one_out_baseline=False)
    assert (cfg.adv_estimator.normalize_rewards, cfg.adv_estimator.use_leave_one_out_baseline) == (
        False, False
    )
    cfg = GRPOConfig(adv_estimator={"normalize_rewards": False})
    assert cfg.adv_estimator.normalize_rewards is False
    with pytest.raises(ValueError, match=r"grpo.normalize_rewards \(True\) and "
                       r"grpo.adv_estimator.normalize_rewards \(False\) disagree"):
        GRPOConfig(normalize_rewards=True, adv_estimator={"normalize_rewards": False})
    with pytest.raises(ValueError, match="'rloo' is a leave-one-out baseline without"):
        GRPOConfig(adv_estimator={"name": "rloo", "normalize_rewards": True})
    with pytest.raises(ValueError, match="needs num_generations_per_prompt >= 2"):
        GRPOConfig(num_generations_per_prompt=1, adv_estimator={"name": "rloo"})
    with pytest.raises(ValueError, match="adv_estimator.name"):
        GRPOConfig(adv_estimator={"name": "gae"})
    # REINFORCE++ has no leave-one-out baseline: one generation per prompt is fine
    GRPOConfig(num_generations_per_prompt=1, use_leave_one_out_baseline=False,
               adv_estimator={"name": "reinforce_plus_plus"})
