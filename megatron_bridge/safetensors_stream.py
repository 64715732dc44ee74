"""Write a safetensors file from tensors that arrive one at a time, holding none of them.

The safetensors header (names, dtypes, shapes, byte offsets) precedes the data. The tensors
of a converted checkpoint are known before their data (names and shapes from the conversion
plan, one dtype), so :class:`SafetensorsStreamWriter` takes them up front, writes the header
at once and then appends each tensor's bytes as it arrives: one pass over the data, straight
into the final file. Memory held: the header entries only.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]
"""A tensor's name, dtype and shape."""


def tensor_nbytes(spec: TensorSpec) -> int:
    """Bytes of a tensor with this spec."""
    return math.prod(spec[2]) * spec[1].itemsize


class SafetensorsStreamWriter:
    """One safetensors file at ``path`` holding the tensors ``specs`` lists, in that order.

    Args:
        path: the file to write (replaced).
        specs: name, dtype and shape of every tensor, in the order :meth:`add` receives them.
        metadata: the header's ``__metadata__`` string map (e.g. ``{"format": "pt"}``).

    Raises:
        ValueError: a repeated name, or a dtype safetensors cannot store.
    """

    def __init__(
        self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self._specs = list(specs)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, dtype, shape in self._specs:
            if name in header:
                raise ValueError(f"tensor {name!r} is listed twice for {self.path}")
            if dtype not in _DTYPE_NAMES:
                raise ValueError(
                    f"tensor {name!r} has dtype {dtype}; safetensors here supports "
                    f"{sorted(str(d) for d in _DTYPE_NAMES)}"
                )
            size = tensor_nbytes((name, dtype, shape))
            header[name] = {
                "dtype": _DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # Pad with spaces so the data starts 8-byte aligned, as safetensors' own writer does.
        encoded += b" " * (-len(encoded) % 8)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._written = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (a CPU tensor), which must be the next one of ``specs``.

        Raises:
            ValueError: a name, dtype or shape other than the next spec's.
        """
        if self._written == len(self._specs):
            raise ValueError(f"{self.path}: tensor {name!r} is one more than the header lists")
        expected = self._specs[self._written]
        if (name, tensor.dtype, tuple(tensor.shape)) != expected:
            raise ValueError(
                f"{self.path}: got {name!r} {tensor.dtype} {tuple(tensor.shape)} where the "
                f"header lists {expected[0]!r} {expected[1]} {expected[2]}"
            )
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._written += 1

    def close(self) -> None:
        """Close the file.

        Raises:
            ValueError: fewer tensors were added than the header lists.
        """
        self._file.close()
        if self._written != len(self._specs):
            raise ValueError(
                f"{self.path}: {self._written} of the {len(self._specs)} tensors its header "
                f"lists were written"
            )
