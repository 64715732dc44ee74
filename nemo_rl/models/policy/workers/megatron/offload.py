"""Release device memory around a refit and take it back for training.

Order in a colocated step: :func:`offload_optimizer_and_grads` before the generation engine
wakes up (optimizer state to the CPU, gradient buffers freed: they are zeroed before every
step anyway), :func:`offload_params` once the engine has the weights, and :func:`reload_all`
before the next training step.

Gradient and parameter buffers of megatron's DDP are freed by resizing their storage to zero
and restored by resizing back, so the views DDP and the optimizer hold into them stay valid.
What leaves the device goes into a :class:`HostStash` of pinned host buffers, allocated at the
first offload and reused by every later one: a copy into pageable memory runs at a small
fraction of the PCIe bandwidth, and pinning fresh memory every step costs more than the copy.

On a CPU-only machine nothing is moved (the "device" is the host): every function is a no-op
that returns the bytes it would move, so callers can log the same figures on both.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from nemo_rl.models.policy.workers.megatron.model_setup import (
    FrozenStage,
    PolicyModel,
    optimizer_states,
)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _ddp_buffers(ddp: Any) -> list[Any]:
    if isinstance(ddp, FrozenStage):  # no DDP: its parameters are plain tensors
        return []
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))


def _on_device() -> bool:
    return torch.cuda.is_available()


class HostStash:
    """Pinned host buffers for offloaded device tensors, one per key, kept across offloads.

    Attributes:
        params: the DDP parameter buffers now offloaded: ``id(buffer)`` -> their host copy.
    """

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self.params: dict[int, torch.Tensor] = {}

    def put(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """Start copying ``tensor`` into ``key``'s pinned buffer (allocated, or replaced when
        the shape or dtype changed); the buffer. The copy is asynchronous: synchronize the
        device before reading it."""
        host = self._buffers.get(key)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffers[key] = host
        host.copy_(tensor, non_blocking=True)
        return host


def offload_optimizer_and_grads(policy: PolicyModel, stash: HostStash) -> int:
    """Optimizer state to ``stash`` and gradient buffers freed.

    Returns:
        Bytes moved or freed (optimizer state + gradient buffers).
    """
    moved = 0
    for state in optimizer_states(policy.optimizer):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                moved += _nbytes(value)
                # scalars stay (a fused Adam's step counters live on the device)
                if _on_device() and value.device.type == "cuda" and value.dim() > 0:
                    state[key] = stash.put(("optimizer", id(state), key), value)
    for buffer in _ddp_buffers(policy.model):
        moved += _nbytes(buffer.grad_data)
        if _on_device():
            buffer.grad_data.untyped_storage().resize_(0)
    if _on_device():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved


def offload_params(policy: PolicyModel, stash: HostStash) -> int:
    """Parameters to ``stash`` (what :func:`reload_all` restores).

    Returns:
        Bytes of parameters moved.
    """
    moved = 0
    buffers = [b for b in _ddp_buffers(policy.model) if b.param_data is not None]
    if buffers:
        for buffer in buffers:
            moved += _nbytes(buffer.param_data)
            if _on_device():
                stash.params[id(buffer)] = stash.put(("params", id(buffer)), buffer.param_data)
                # stream-ordered: the allocator reuses this memory only after the copy ran
                buffer.param_data.untyped_storage().resize_(0)
    else:
        for param in policy.model.parameters():
            moved += _nbytes(param)
            if _on_device():
                param.data = stash.put(("param", id(param)), param.data)
    if _on_device():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved


def reload_all(policy: PolicyModel, stash: HostStash) -> int:
    """Undo both offloads: parameters, gradient buffers (zeroed) and optimizer state.

    Returns:
        Bytes brought back to the device (0 on a CPU-only machine).
    """
    if not _on_device():
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    moved = 0
    for buffer in _ddp_buffers(policy.model):
        if id(buffer) in stash.params:
            host = stash.params.pop(id(buffer))
            buffer.param_data.untyped_storage().resize_(_nbytes(host))
            buffer.param_data.copy_(host, non_blocking=True)
            moved += _nbytes(host)
        grad_bytes = _nbytes(buffer.grad_data)
        if buffer.grad_data.untyped_storage().size() == 0:
            buffer.grad_data.untyped_storage().resize_(grad_bytes)
            buffer.grad_data.zero_()
            moved += grad_bytes
    for param in policy.model.parameters():
        if param.device.type == "cpu":
            param.data = param.data.to(device, non_blocking=True)
            moved += _nbytes(param)
    for state in optimizer_states(policy.optimizer):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)
                moved += _nbytes(value)
    torch.cuda.synchronize()
    return moved
