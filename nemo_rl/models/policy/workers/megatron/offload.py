"""Release device memory around a refit and take it back for training.

Order in a colocated step: :func:`offload_optimizer_and_grads` before the generation engine
wakes up (optimizer state to the CPU, gradient buffers freed: they are zeroed before every
step anyway), :func:`offload_params` once the engine has the weights, and :func:`reload_all`
before the next training step.

Gradient and parameter buffers of megatron's DDP are freed by resizing their storage to zero
and restored by resizing back, so the views DDP and the optimizer hold into them stay valid.

On a CPU-only machine nothing is moved (the "device" is the host): every function is a no-op
that returns the bytes it would move, so callers can log the same figures on both.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_rl.models.policy.workers.megatron.model_setup import PolicyModel, optimizer_states


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _ddp_buffers(ddp: Any) -> list[Any]:
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))


def _on_device() -> bool:
    return torch.cuda.is_available()


def offload_optimizer_and_grads(policy: PolicyModel) -> int:
    """Optimizer state to the CPU and gradient buffers freed.

    Returns:
        Bytes moved or freed (optimizer state + gradient buffers).
    """
    moved = 0
    for state in optimizer_states(policy.optimizer):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                moved += _nbytes(value)
                if _on_device():
                    state[key] = value.to("cpu", non_blocking=True)
    for buffer in _ddp_buffers(policy.model):
        moved += _nbytes(buffer.grad_data)
        if _on_device():
            buffer.grad_data.untyped_storage().resize_(0)
    if _on_device():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved


def offload_params(policy: PolicyModel, host_copies: dict[int, torch.Tensor]) -> int:
    """Parameters to the CPU; ``host_copies`` receives what :func:`reload_all` restores.

    Returns:
        Bytes of parameters moved.
    """
    moved = 0
    buffers = [b for b in _ddp_buffers(policy.model) if b.param_data is not None]
    if buffers:
        for buffer in buffers:
            moved += _nbytes(buffer.param_data)
            if _on_device():
                host_copies[id(buffer)] = buffer.param_data.to("cpu")
                buffer.param_data.untyped_storage().resize_(0)
    else:
        for param in policy.model.parameters():
            moved += _nbytes(param)
            if _on_device():
                param.data = param.data.to("cpu")
    if _on_device():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved


def reload_all(policy: PolicyModel, host_copies: dict[int, torch.Tensor]) -> int:
    """Undo both offloads: parameters, gradient buffers (zeroed) and optimizer state.

    Returns:
        Bytes brought back to the device (0 on a CPU-only machine).
    """
    if not _on_device():
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    moved = 0
    for buffer in _ddp_buffers(policy.model):
        if id(buffer) in host_copies:
            host = host_copies.pop(id(buffer))
            buffer.param_data.untyped_storage().resize_(_nbytes(host))
            buffer.param_data.copy_(host)
            moved += _nbytes(host)
        grad_bytes = _nbytes(buffer.grad_data)
        if buffer.grad_data.untyped_storage().size() == 0:
            buffer.grad_data.untyped_storage().resize_(grad_bytes)
            buffer.grad_data.zero_()
            moved += grad_bytes
    for param in policy.model.parameters():
        if param.device.type == "cpu":
            param.data = param.data.to(device)
            moved += _nbytes(param)
    for state in optimizer_states(policy.optimizer):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0:
                state[key] = value.to(device)
                moved += _nbytes(value)
    torch.cuda.synchronize()
    return moved
