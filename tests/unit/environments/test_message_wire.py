"""pack_message_logs / unpack_message_logs: conversations cross a pickle boundary unchanged."""

from __future__ import annotations

import pickle

import torch

from nemo_rl.environments.message_wire import (
    PackedTensor,
    pack_message_logs,
    unpack_message_logs,
)


def test_tensors_travel_as_numpy_and_come_back_equal() -> None:
    logs = [
        [
            {"role": "user", "content": "2+2?", "token_ids": torch.arange(5)},
            {
                "role": "assistant",
                "content": "4",
                "token_ids": torch.tensor([7, 8]),
                "generation_logprobs": torch.tensor([-0.5, -1.25]),
                "mask": torch.tensor([True, False]),
                "bf16": torch.tensor([1.5], dtype=torch.bfloat16),
                "strided": torch.arange(6).reshape(2, 3).t(),
            },
        ]
    ]
    packed = pack_message_logs(logs)
    assistant = packed[0][1]
    assert isinstance(assistant["token_ids"], PackedTensor)
    assert isinstance(assistant["bf16"], torch.Tensor)  # numpy has no bfloat16: sent as is
    assert assistant["content"] == "4"
    assert logs[0][1]["token_ids"] is not assistant["token_ids"]  # the input is not changed

    received = unpack_message_logs(pickle.loads(pickle.dumps(packed, protocol=5)))
    for sent_log, got_log in zip(logs, received):
        for sent, got in zip(sent_log, got_log):
            assert sent.keys() == got.keys()
            for key, value in sent.items():
                if isinstance(value, torch.Tensor):
                    assert isinstance(got[key], torch.Tensor)
                    assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
                else:
                    assert got[key] == value
    # a received tensor is the environment's to change
    received[0][0]["token_ids"].add_(1)
    assert received[0][0]["token_ids"].tolist() == [1, 2, 3, 4, 5]


def test_read_only_arrays_are_copied_into_writable_tensors() -> None:
    array = torch.arange(3).numpy().copy()
    array.setflags(write=False)
    tensor = PackedTensor(array).tensor()
    tensor.add_(1)
    assert tensor.tolist() == [1, 2, 3] and array.tolist() == [0, 1, 2]
