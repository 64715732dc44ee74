"""The local layer spec's normalisation: torch's ``RMSNorm`` / ``LayerNorm``, also under
sequence parallelism.

megatron-core's own local norm (``megatron.core.transformer.torch_norm.WrappedTorchNorm``)
refuses ``sequence_parallel``; only TransformerEngine's and apex's norms take it. Under sequence
parallelism each TP rank normalises its own slice of the sequence, so the norm's weight (and
bias), replicated over TP, gets a different partial gradient on every rank. megatron-core's
gradient finalisation (``finalize_model_grads._allreduce_non_tensor_model_parallel_grads``)
sums over the TP group the gradients of parameters that carry ``sequence_parallel=True`` when
the config has ``sequence_parallel`` on; :class:`LocalNorm` tags its parameters so, as
TransformerEngine's norm does. The arithmetic is torch's, so without sequence parallelism the
model computes bit for bit what it computes with ``WrappedTorchNorm``.

The q/k norms of attention (Qwen3's ``q_layernorm`` / ``k_layernorm``) are the same module:
they normalise each head's vector, their TP ranks see different heads (whatever the sequence
split), and megatron-core sums their gradients over TP by name whenever ``qk_layernorm`` is on,
so the tag adds no second reduction (the finaliser takes each parameter once).

Compute dtype: torch builds the norm's parameters in float32, and a bf16 activation with a
float32 weight cannot use torch's fused norm kernel (torch warns "cannot dispatch to fused
implementation" and runs several unfused float32 kernels). The norms here cast their weight
(and bias) to the input's dtype in the forward, so the fused kernel runs in the compute dtype;
the parameters, their gradients (through the cast) and checkpoints stay float32. With float32
activations nothing changes. In bf16 the output differs from the float32-weight norm by the
weight's rounding to bf16 (at most one bf16 ulp of each output, relative 2**-8).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _in_dtype(param: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return param if param is None or param.dtype == dtype else param.to(dtype)


class ComputeDtypeRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose weight is cast to the input's dtype in the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, _in_dtype(self.weight, x.dtype), self.eps)


class ComputeDtypeLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose weight and bias are cast to the input's dtype in the
    forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x, self.normalized_shape, _in_dtype(self.weight, x.dtype),
            _in_dtype(self.bias, x.dtype), self.eps,
        )


class LocalNorm:
    """Builds torch's ``RMSNorm`` or ``LayerNorm`` (per ``config.normalization``; in the
    input's dtype, :class:`ComputeDtypeRMSNorm`) over the last ``hidden_size`` features, its
    parameters tagged with ``sequence_parallel``.

    A spec entry like megatron's norms: ``build_module`` calls it with the transformer config,
    the normalised size (``hidden_size``, or the head size for q/k norms) and epsilon.

    Raises:
        ValueError: an unsupported ``config.normalization``, or a zero-centred gamma.
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
        kind = config.normalization
        norm_classes = {"RMSNorm": ComputeDtypeRMSNorm, "LayerNorm": ComputeDtypeLayerNorm}
        if kind not in norm_classes:
            raise ValueError(
                f"the local layer spec supports normalization RMSNorm or LayerNorm, not "
                f"{kind!r}; install TransformerEngine for other norms"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError(
                "layernorm_zero_centered_gamma needs TransformerEngine's norm; turn it off for "
                "the local layer spec"
            )
        norm = norm_classes[kind](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
