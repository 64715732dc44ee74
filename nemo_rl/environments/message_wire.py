"""Conversations on their way to an environment actor, with their tensors as numpy arrays.

A rollout step sends an environment every conversation of its samples, and each message holds
small tensors (``token_ids``, ``generation_logprobs``). Ray pickles a torch tensor through
torch's own reducer, which costs tens of microseconds per tensor each way: for 128 two-message
conversations (about 400 tensors) that is about 0.1 s per environment call on one CPU core, more
than the environment's own work. A numpy array shares the tensor's memory and pickles about
twenty times faster, so :func:`pack_message_logs` swaps every CPU tensor it can for a
:class:`PackedTensor` (a numpy view) and :func:`unpack_message_logs` turns them back into
tensors on the other side. The environment sees the conversations exactly as sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nemo_rl.data.interfaces import LLMMessageLogType

# torch dtypes with a numpy equivalent (bfloat16, float8 and the like have none and travel as
# tensors).
_NUMPY_DTYPES = frozenset(
    {
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.float32, torch.float64,
    }
)


class PackedTensor:
    """A CPU tensor travelling as a numpy array (its memory, not a copy)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[type[PackedTensor], tuple[np.ndarray]]:
        return PackedTensor, (self.array,)

    def tensor(self) -> torch.Tensor:
        """The tensor again; a copy only when the received array is read-only (an array
        deserialized zero-copy from Ray's object store)."""
        array = self.array if self.array.flags.writeable else self.array.copy()
        return torch.from_numpy(array)


def _pack(value: Any) -> Any:
    if (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.dtype in _NUMPY_DTYPES
        and not value.requires_grad
    ):
        return PackedTensor(value.numpy())
    return value


def _unpack(value: Any) -> Any:
    return value.tensor() if isinstance(value, PackedTensor) else value


def pack_message_logs(message_logs: list[LLMMessageLogType]) -> list[list[dict[str, Any]]]:
    """``message_logs`` with each message's CPU tensors as :class:`PackedTensor` (other values,
    and tensors numpy cannot hold, unchanged); the messages are new dicts, the data shared."""
    return [[{k: _pack(v) for k, v in message.items()} for message in log] for log in message_logs]


def unpack_message_logs(packed: list[list[dict[str, Any]]]) -> list[LLMMessageLogType]:
    """Undo :func:`pack_message_logs`: every :class:`PackedTensor` a tensor again."""
    return [[{k: _unpack(v) for k, v in message.items()} for message in log] for log in packed]
