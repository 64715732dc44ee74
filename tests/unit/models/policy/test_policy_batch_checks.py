"""Bad batches given to the Policy facade (the Python API) are refused before any worker runs,
naming the field or the setting and the fix."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.lm_policy import check_batch, check_global_batch

IDS = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])


def test_a_well_formed_batch_passes():
    check_batch(BatchedDataDict(input_ids=IDS, input_lengths=torch.tensor([3, 2])), "X")


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"input_lengths": torch.tensor([3, 2])}, r"X needs data\['input_ids'\].*no such key"),
        ({"input_ids": IDS.float(), "input_lengths": torch.tensor([3, 2])},
         r"integer tensor \[batch, seq\].*torch.float32 \[2, 4\]"),
        ({"input_ids": IDS}, r"X needs data\['input_lengths'\].*\(input_ids != pad_token_id\)"),
        ({"input_ids": IDS, "input_lengths": torch.tensor([3])}, r"\[batch\] = \[2\], got \[1\]"),
        ({"input_ids": IDS, "input_lengths": torch.tensor([3, 5])}, r"lie in \[1, 4\].*got 3..5"),
        ({"input_ids": IDS, "input_lengths": torch.tensor([0, 2])}, r"lie in \[1, 4\].*got 0..2"),
    ],
)
def test_malformed_batches_name_the_field(batch, message):
    with pytest.raises(ValueError, match=message):
        check_batch(BatchedDataDict(batch), "X")


def test_global_batch_errors_name_where_the_size_came_from():
    cfg = PolicyConfig(train_global_batch_size=8, train_micro_batch_size=2)
    check_global_batch(16, None, cfg, dp=2)
    with pytest.raises(ValueError, match=r"12 samples, not a multiple of the global batch size 8 "
                       r"\(policy.train_global_batch_size\)"):
        check_global_batch(12, None, cfg, dp=1)
    with pytest.raises(ValueError, match=r"global batch size 5 \(the gbs argument\)"):
        check_global_batch(12, 5, cfg, dp=1)
    with pytest.raises(ValueError, match=r"global batch size 3 \(the gbs argument\) does not "
                       "split over the 2 data-parallel replicas"):
        check_global_batch(12, 3, cfg, dp=2)
