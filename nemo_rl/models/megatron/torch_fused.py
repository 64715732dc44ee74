"""torch's own fused kernels where megatron-core, without TransformerEngine or apex, falls
back to per-tensor loops.

* Multi-tensor ops. megatron-core's fallbacks (``megatron.core.utils.local_multi_tensor_l2_norm``
  / ``local_multi_tensor_scale``) read every tensor's norm back to the host, one device
  synchronisation per parameter tensor each step (about a hundred for a 1 B Llama), and
  allocate a temporary per tensor. :func:`foreach_l2_norm` and :func:`foreach_scale` compute
  the same values with torch's multi-tensor ops and no host round trip; :func:`install` puts
  them where megatron-core looks, only where it fell back.
* Adam. The fallback optimizer is ``torch.optim.AdamW`` with its default multi-tensor
  implementation, several passes over the parameters and their state each step;
  :func:`use_fused_adam` switches it to torch's single-kernel implementation on CUDA.

With TransformerEngine or apex installed, their fused kernels stay and nothing here applies.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_rl.models.megatron.optimizer_parts import optimizer_parts


def foreach_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """The L2 norm of all tensors of ``tensor_lists`` together, float32 ``[1]`` on their
    device (the call convention of apex's ``multi_tensor_l2norm`` through megatron's
    ``multi_tensor_applier``; ``per_tensor`` norms are not produced, as in megatron's own
    fallback)."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """``dst = src * scale`` for each pair of ``tensor_lists = [src, dst]`` (dtypes may
    differ: the result is cast to ``dst``'s), as apex's ``multi_tensor_scale``."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif src is dst:
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install() -> bool:
    """Use :func:`foreach_l2_norm` / :func:`foreach_scale` in megatron-core's optimizer
    modules where they hold megatron's per-tensor fallbacks; True when anything was
    replaced. Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    replaced = False
    for module, name, fallback, ours in (
        (clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, foreach_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale),
        (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale),
    ):
        if getattr(module, name, None) is fallback:
            setattr(module, name, ours)
            replaced = True
    return replaced


def use_fused_adam(optimizer: Any, device_type: str = "cuda") -> int:
    """Switch the ``torch.optim.Adam``/``AdamW`` inside a megatron optimizer (chained or not)
    to torch's fused implementation (``fused=True``), where every parameter is a floating
    tensor on a ``device_type`` device (CUDA; CPU runs keep the default implementation). Call it before the first step (the state's ``step`` counters of a
    fused Adam live on the device). Returns the number of torch optimizers switched."""
    switched = 0
    for wrapper in optimizer_parts(optimizer):
        inner = getattr(wrapper, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or not all(
            p.device.type == device_type and p.is_floating_point() for p in params
        ):
            continue
        for settings in (inner.defaults, *inner.param_groups):
            settings.update(fused=True, foreach=False)
        switched += 1
    return switched
