"""The reference policy: the weights KL penalties and DPO compare the trained policy against.

Two kinds, used alike through ``swapped_in(module)``, a context manager that runs its body with
the reference in ``module`` and restores the trained policy afterwards:

* :class:`ReferenceWeights`: a CPU copy of the trainable parameters at one moment (all of them
  in full training, the adapters' under LoRA: the frozen base never changes). Swapping copies
  in place: megatron's DDP keeps its parameters as views of contiguous buffers, so the tensors
  themselves must not be replaced.
* :class:`AdaptersOff`: a LoRA policy's initial reference, its base model: the adapters are
  switched off, nothing is copied or held.

:func:`take_reference` picks one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from megatron_bridge.lora import adapters_disabled
from megatron_bridge.lora_targets import is_adapter_param


class ReferenceWeights:
    """A CPU copy of ``module``'s parameters at construction (this rank's shards).

    Args:
        module: the model stage whose current weights become the reference.
        adapters_only: copy only the LoRA adapters' parameters (the rest is frozen).
    """

    def __init__(self, module: torch.nn.Module, adapters_only: bool = False) -> None:
        self._weights = {
            name: param.detach().to("cpu", copy=True)
            for name, param in module.named_parameters()
            if not adapters_only or is_adapter_param(name)
        }

    @property
    def nbytes(self) -> int:
        """Bytes held on the CPU."""
        return sum(t.numel() * t.element_size() for t in self._weights.values())

    @contextmanager
    @torch.no_grad()
    def swapped_in(self, module: torch.nn.Module) -> Iterator[None]:
        """Run the body with the reference weights in ``module``; restore its own afterwards."""
        params = {n: p for n, p in module.named_parameters() if n in self._weights}
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


class AdaptersOff:
    """A LoRA policy's base model as its reference: the adapters switched off."""

    nbytes = 0

    def swapped_in(self, module: torch.nn.Module) -> AbstractContextManager[None]:
        """Run the body with ``module``'s adapters off."""
        return adapters_disabled(module)


def take_reference(module: torch.nn.Module, lora: bool, initial: bool) -> ReferenceWeights | AdaptersOff:
    """The reference policy of ``module`` now.

    Args:
        module: the policy's model stage.
        lora: the policy trains LoRA adapters on a frozen base.
        initial: the weights are the initial ones (a LoRA policy's adapters are then zero:
            its base model is the reference, no copy needed).
    """
    if lora and initial:
        return AdaptersOff()
    return ReferenceWeights(module, adapters_only=lora)
