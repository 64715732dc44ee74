"""Write a safetensors file from tensors that arrive one at a time, holding none of them.

The safetensors header (names, dtypes, shapes, byte offsets) precedes the data, but a
stream's header is known only at its end. :class:`SafetensorsStreamWriter` therefore appends
each tensor's bytes to a sibling data file as it arrives, and on :meth:`close` writes the
header followed by the data, copied file-to-file inside the kernel (``os.copy_file_range``:
no bytes pass through this process). Memory held: the header entries only.
"""

from __future__ import annotations

import json
import os
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


class SafetensorsStreamWriter:
    """One safetensors file at ``path``, built from :meth:`add` calls, complete after :meth:`close`.

    Args:
        path: the file to write (replaced on close).
        metadata: the header's ``__metadata__`` string map (e.g. ``{"format": "pt"}``).
    """

    def __init__(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self._metadata = dict(metadata or {})
        self._entries: dict[str, dict] = {}
        self._size = 0
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._data = open(self._data_path, "wb")

    @property
    def nbytes(self) -> int:
        """Tensor bytes written so far."""
        return self._size

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (a CPU tensor of any shape) under ``name``.

        Raises:
            ValueError: a repeated name, or a dtype safetensors cannot store.
        """
        if name in self._entries:
            raise ValueError(f"tensor {name!r} was already written to {self.path}")
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"tensor {name!r} has dtype {tensor.dtype}; safetensors here supports "
                f"{sorted(str(d) for d in _DTYPE_NAMES)}"
            )
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        self._data.write(memoryview(data))
        self._entries[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._size, self._size + data.nbytes],
        }
        self._size += data.nbytes

    def close(self) -> None:
        """Write the header and the data into ``path`` and remove the data file."""
        self._data.close()
        header: dict = {"__metadata__": self._metadata} if self._metadata else {}
        header.update(self._entries)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # Pad with spaces so the data starts 8-byte aligned, as safetensors' own writer does.
        encoded += b" " * (-len(encoded) % 8)
        try:
            with open(self._data_path, "rb") as src, open(self.path, "wb") as dst:
                dst.write(struct.pack("<Q", len(encoded)) + encoded)
                dst.flush()
                copied = 0
                while copied < self._size:
                    done = os.copy_file_range(src.fileno(), dst.fileno(), self._size - copied)
                    if done == 0:
                        raise OSError(f"{self._data_path} is shorter than the {self._size} "
                                      f"bytes written to it")
                    copied += done
        finally:
            os.unlink(self._data_path)
