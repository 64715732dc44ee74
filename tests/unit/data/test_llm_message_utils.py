"""Prompt collate function and flattening of message logs."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.data.interfaces import DatumSpec, Message
from nemo_rl.data.llm_message_utils import message_logs_to_flat, rl_collate_fn


def _msg(role: str, ids: list[int], logprobs: list[float] | None = None) -> Message:
    message = Message(role=role, content="", token_ids=torch.tensor(ids, dtype=torch.int64))
    if logprobs is not None:
        message["generation_logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
    return message


def test_message_logs_to_flat() -> None:
    logs = [
        [_msg("user", [5, 6, 7]), _msg("assistant", [8, 9], [-0.5, -0.25])],
        [
            _msg("system", [1]),
            _msg("user", [2]),
            _msg("assistant", [3], [-1.0]),
            _msg("environment", [4, 4]),
            _msg("assistant", [5, 6]),  # no generation logprobs (e.g. an SFT reply)
        ],
        [_msg("user", [11])],
    ]
    flat = message_logs_to_flat(logs, pad_token_id=0)
    assert flat["input_ids"].tolist() == [
        [5, 6, 7, 8, 9, 0, 0],
        [1, 2, 3, 4, 4, 5, 6],
        [11, 0, 0, 0, 0, 0, 0],
    ]
    assert flat["input_lengths"].tolist() == [5, 7, 1]
    assert flat["token_mask"].tolist() == [
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 1, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 0, 0],
    ]
    assert flat["generation_logprobs"].dtype == torch.float32
    assert flat["generation_logprobs"].tolist() == [
        [0, 0, 0, -0.5, -0.25, 0, 0],
        [0, 0, -1.0, 0, 0, 0, 0],
        [0] * 7,
    ]


def test_message_logs_to_flat_checks_logprob_count() -> None:
    with pytest.raises(ValueError, match="row 0: an assistant message has 2 tokens but 1"):
        message_logs_to_flat([[_msg("assistant", [1, 2], [-1.0])]], pad_token_id=0)
    with pytest.raises(ValueError, match="no message logs"):
        message_logs_to_flat([], pad_token_id=0)


def test_rl_collate_fn() -> None:
    data = [
        DatumSpec(
            message_log=[_msg("user", [1, 2])],
            length=2,
            extra_env_info={"ground_truth": "3"},
            loss_multiplier=1.0,
            idx=4,
            task_name="math",
        ),
        DatumSpec(
            message_log=[_msg("user", [3])],
            length=1,
            extra_env_info={"ground_truth": "5"},
            loss_multiplier=0.0,
            idx=9,
            task_name="game",
            stop_strings=["</guess>"],
        ),
    ]
    batch = rl_collate_fn(data)
    assert batch.size == 2
    assert batch["message_log"][1] is data[1]["message_log"]
    assert batch["length"].tolist() == [2, 1] and batch["length"].dtype == torch.int64
    assert batch["loss_multiplier"].tolist() == [1.0, 0.0]
    assert batch["loss_multiplier"].dtype == torch.float32
    assert batch["idx"] == [4, 9] and batch["task_name"] == ["math", "game"]
    assert batch["extra_env_info"] == [{"ground_truth": "3"}, {"ground_truth": "5"}]
    assert batch["stop_strings"] == [None, ["</guess>"]]
    assert batch.repeat_interleave(2)["idx"] == [4, 4, 9, 9]
