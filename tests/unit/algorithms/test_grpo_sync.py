"""The data-plane loop's data path gives the in-memory loop's training batch, bit for bit.

A rollout is stored as the SyncRolloutActor stores it, the driver's per-sample fields come from
the carry, and a worker's fetch rebuilds the batch; it must equal ``grpo.build_train_data`` of
the same rollout (same tensors, dtypes, shapes) and give the same metrics.
"""

from __future__ import annotations

import pytest
import torch

from nemo_rl.algorithms.grpo import build_train_data
from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.algorithms.grpo_sync import train_fields_from_carry
from nemo_rl.data_plane import InProcessDataPlane
from nemo_rl.data_plane.columns import write_columns
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.sync_rollout_actor import RolloutCarry, store_rollout
from nemo_rl.models.policy.workers.megatron.data_plane_io import fetch_batch

PAD = 7
# (prompt tokens, response tokens, reward) per row; rows 2g, 2g+1 form group g
ROWS = [(3, 4, 1.0), (3, 2, 0.0), (5, 6, 0.5), (5, 6, 0.5), (2, 1, 0.0), (2, 7, 1.0)]


def rollout_batch() -> tuple[BatchedDataDict, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    logs = []
    for prompt, response, _ in ROWS:
        logs.append(
            [
                {"role": "user", "content": "", "token_ids": torch.randint(10, 50, (prompt,), generator=g)},
                {
                    "role": "assistant",
                    "content": "",
                    "token_ids": torch.randint(10, 50, (response,), generator=g),
                    "generation_logprobs": -torch.rand(response, generator=g),
                },
            ]
        )
    rollout = BatchedDataDict(
        message_log=logs,
        total_reward=torch.tensor([r for _, _, r in ROWS]),
        loss_multiplier=torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0]),
        truncated=torch.tensor([False, False, False, False, True, False]),
        response_truncated=torch.tensor([False, True, False, False, True, False]),
    )
    return rollout, torch.arange(len(ROWS)) // 2


@pytest.mark.parametrize(
    "loo, normalize, overlong", [(True, True, True), (False, True, False), (False, False, True)]
)
def test_fetched_batch_equals_in_memory_train_data(loo: bool, normalize: bool, overlong: bool) -> None:
    grpo_cfg = GRPOConfig(
        num_generations_per_prompt=2,
        use_leave_one_out_baseline=loo,
        normalize_rewards=normalize,
        overlong_filtering=overlong,
    )
    rollout, group_ids = rollout_batch()
    want, want_metrics = build_train_data(rollout, group_ids, grpo_cfg, PAD)

    plane = InProcessDataPlane()
    plane.register_partition("train")
    keys = [f"s{i}" for i in range(len(ROWS))]
    meta = store_rollout(plane, "train", keys, rollout, PAD)
    carry = RolloutCarry.from_rollout(rollout, group_ids, {}, sampling_step=0)
    fields, metrics = train_fields_from_carry(carry, grpo_cfg)
    assert {name: t.shape for name, t in fields.items()} == {
        "advantages": (len(ROWS),), "sample_mask": (len(ROWS),)
    }
    meta = write_columns(plane, meta, fields)
    got = fetch_batch(plane, meta)

    assert metrics == want_metrics
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    assert (want["advantages"] != 0).any()  # the comparison covers real advantages


def test_carry_select_and_concat_keep_rows_aligned() -> None:
    rollout, group_ids = rollout_batch()
    carry = RolloutCarry.from_rollout(rollout, group_ids, {"reward_mean": 0.5}, sampling_step=3)
    picked = carry.select(torch.tensor([5, 0]))
    assert picked.group_ids.tolist() == [2, 0] and picked.rewards.tolist() == [1.0, 1.0]
    assert picked.truncated.tolist() == [False, False] and picked.sampling_step == 3
    joined = RolloutCarry.concat([picked, carry.select([4])], {"reward_mean": 0.25})
    assert joined.size == 3 and joined.truncated.tolist() == [False, False, True]
    assert joined.metrics == {"reward_mean": 0.25}
