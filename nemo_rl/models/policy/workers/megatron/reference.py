"""The reference policy: this rank's initial weights, kept on the CPU.

:meth:`ReferenceWeights.swapped_in` copies them into the live parameters for the duration of a
``with`` block and restores the trained weights afterwards, in place: megatron's DDP keeps its
parameters as views of contiguous buffers, so the tensors themselves must not be replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ReferenceWeights:
    """A CPU copy of ``module``'s parameters at construction (this rank's shards).

    Args:
        module: the model stage whose current weights become the reference.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._weights = {
            name: param.detach().to("cpu", copy=True) for name, param in module.named_parameters()
        }

    @property
    def nbytes(self) -> int:
        """Bytes held on the CPU."""
        return sum(t.numel() * t.element_size() for t in self._weights.values())

    @contextmanager
    @torch.no_grad()
    def swapped_in(self, module: torch.nn.Module) -> Iterator[None]:
        """Run the body with the reference weights in ``module``; restore its own afterwards."""
        params = dict(module.named_parameters())
        if params.keys() != self._weights.keys():
            raise ValueError("the module's parameters differ from those the reference was taken of")
        current = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        for name, param in params.items():
            param.copy_(self._weights[name])
        try:
            yield
        finally:
            for name, param in params.items():
                param.copy_(current[name])
