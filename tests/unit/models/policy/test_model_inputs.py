"""Model rows under sequence parallelism (``build_model_inputs``, no process group): every CP
rank's share of a padded row or a pack splits into TP equal parts, the tokens stay where they
were, and the pack's extra padding goes to its last sample only. (The two-process tests in
``test_algorithm_layouts.py`` and ``test_moe_layouts.py`` check the numbers at TP=2.)"""

from __future__ import annotations

import pytest
import torch

from nemo_rl.models.policy.workers.megatron.forward import build_model_inputs


def _micro_batch(lengths: list[int], seq: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, len(lengths) * seq + 1).view(len(lengths), seq)
    return {"input_ids": ids, "input_lengths": torch.tensor(lengths)}


@pytest.mark.parametrize(
    ("cp", "sp", "full_len"),
    [(1, 1, 13), (1, 2, 14), (1, 4, 16), (2, 1, 16), (2, 2, 16), (2, 4, 16)],
)
def test_padded_rows_split_over_cp_and_tp(cp: int, sp: int, full_len: int) -> None:
    mb = _micro_batch([13, 5], 13)
    inputs = build_model_inputs(mb, False, cp, 0, sp)
    assert inputs.full_len == full_len and inputs.seq_len == 13
    assert inputs.input_ids.shape == (2, full_len // cp)
    assert (full_len // cp) % sp == 0
    if cp == 1:
        assert torch.equal(inputs.input_ids[:, :13], mb["input_ids"])
        assert not inputs.input_ids[:, 13:].any()


@pytest.mark.parametrize(
    ("cp", "sp", "padded"),
    [(1, 1, [6, 4]), (1, 2, [6, 4]), (1, 4, [6, 6]), (2, 2, [8, 4]), (2, 4, [8, 8])],
)
def test_pack_pads_its_last_sample_to_split_over_tp(cp: int, sp: int, padded: list[int]) -> None:
    mb = _micro_batch([5, 4], 6)
    inputs = build_model_inputs(mb, True, cp, 0, sp)
    params = inputs.packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 5, 9]
    assert params.cu_seqlens_q_padded.tolist() == [0, padded[0], sum(padded)]
    assert inputs.sample_offsets.tolist() == [0, padded[0]]
    assert inputs.full_len == sum(padded) and (sum(padded) // cp) % sp == 0
    if cp == 1:
        row = inputs.input_ids[0]
        assert torch.equal(row[:5], mb["input_ids"][0, :5])
        assert torch.equal(row[padded[0] : padded[0] + 4], mb["input_ids"][1, :4])
        assert inputs.position_ids[0, padded[0] :].tolist() == list(range(padded[1]))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("cp", "sp"), [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)])
def test_padding_mask_marks_every_position_without_a_real_token(
    packed: bool, cp: int, sp: int
) -> None:
    """Over all CP ranks, the positions the padding mask leaves unmarked hold exactly the real
    tokens (the rows' ids past their lengths are not zero here: the mask follows the lengths,
    not the ids), so mixture-of-experts routers count no padding token."""
    mb = _micro_batch([5, 3], 6)
    real = torch.cat([mb["input_ids"][0, :5], mb["input_ids"][1, :3]])
    seen = []
    for rank in range(cp):
        inputs = build_model_inputs(mb, packed, cp, rank, sp)
        assert inputs.padding_mask.shape == inputs.input_ids.shape
        assert inputs.padding_mask.dtype == torch.bool
        seen.append(inputs.input_ids[~inputs.padding_mask])
    assert sorted(torch.cat(seen).tolist()) == sorted(real.tolist())
