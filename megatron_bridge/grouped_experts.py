"""Mixture-of-experts experts computed as grouped matrix products.

megatron-core's local experts (``SequentialMLP``) loop over the local experts: per expert a
split of the tokens, two matmuls and an activation, ``2 x experts`` small kernels per layer
and direction (128 experts per layer for Qwen3-30B-A3B). Its grouped alternatives need
TransformerEngine (``TEGroupedMLP``) or the ``grouped_gemm`` package (``GroupedMLP``, bf16
only), and both store the experts in their own tensor layout.

:class:`GroupedGemmExperts` keeps ``SequentialMLP``'s parameters, names and checkpoint layout
(so the bridge's conversion, refit and distributed checkpoints are unchanged) and computes all
local experts of a layer in two grouped GEMMs with ``torch._grouped_mm`` (CUTLASS kernels on
Hopper and newer, a per-group fallback elsewhere, CPU included). The experts' weights are
stacked for each product (a copy of ``experts x out x in`` elements, freed after it) and are
not kept for the backward pass, which stacks them again.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from megatron_bridge.cpu_compat import import_megatron_core

import_megatron_core()  # before megatron-core's first import: defers its compiles on CPU

from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402

# torch._grouped_mm wants every row stride of its operands to be a multiple of 16 bytes.
_STRIDE_ALIGNMENT_BYTES = 16


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weights[e].T`` for every expert ``e``.

    Args (forward):
        x: tokens sorted by expert [tokens, in].
        offsets: int32 [experts], the end row of each expert's tokens (cumulative counts).
        weights: one [out, in] weight per expert.

    Returns:
        [tokens, out].
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, offsets: Tensor, *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        x, offsets, *weights = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_y, torch.stack(weights), offs=offsets)
        grad_weights: tuple[Tensor | None, ...] = (None,) * len(weights)
        if any(ctx.needs_input_grad[2:]):
            # [out, tokens] x [tokens, in] split along tokens -> [experts, out, in]
            grad_weights = torch._grouped_mm(grad_y.t(), x, offs=offsets).unbind(0)
        return (grad_x, None, *grad_weights)


class GroupedGemmExperts(SequentialMLP):
    """``SequentialMLP`` (same constructor, parameters and checkpoint) whose forward runs every
    local expert at once: fc1 as one grouped GEMM, the activation and router weights on all
    tokens, fc2 as a second grouped GEMM.

    Falls back to ``SequentialMLP``'s loop (with one warning, at construction) where the
    grouped kernels cannot take the shapes: weight rows not a multiple of 16 bytes (e.g. a
    tiny model in bf16 at TP > 1).

    Raises:
        ValueError: at construction, for experts with biases, fp8/fp4, probabilities applied
            on the input, or a fused activation other than SwiGLU; ``moe_grouped_gemm: false``
            runs those.
    """

    def __init__(self, num_local_experts: int, config: Any, submodules: Any, **kwargs: Any):
        super().__init__(num_local_experts, config, submodules, **kwargs)
        config = self.config
        if config.add_bias_linear or config.fp8 or config.fp4 or config.moe_apply_probs_on_input:
            raise ValueError(
                "moe_grouped_gemm supports experts without biases, without fp8/fp4 and with the "
                "router weights applied after the activation; this model's config has "
                f"add_bias_linear={config.add_bias_linear}, fp8={config.fp8}, fp4={config.fp4}, "
                f"moe_apply_probs_on_input={config.moe_apply_probs_on_input}: set "
                "policy.megatron_cfg.moe_grouped_gemm=false"
            )
        swiglu = config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
        if config.bias_activation_fusion and not swiglu:
            raise ValueError(
                "moe_grouped_gemm fuses the activation (bias_activation_fusion) only for SwiGLU "
                "experts: set bias_activation_fusion=false or "
                "policy.megatron_cfg.moe_grouped_gemm=false"
            )
        first = self.local_experts[0]
        rows = {
            "linear_fc1": tuple(first.linear_fc1.weight.shape),
            "linear_fc2": tuple(first.linear_fc2.weight.shape),
        }
        itemsize = first.linear_fc1.weight.element_size()
        self.grouped = all(d * itemsize % _STRIDE_ALIGNMENT_BYTES == 0 for s in rows.values() for d in s)
        if not self.grouped and num_local_experts > 1:
            # one warning per distinct message (Python's default filter), not one per layer
            warnings.warn(
                f"moe_grouped_gemm: expert weight shapes {rows} at {itemsize} bytes per element "
                f"are not multiples of {_STRIDE_ALIGNMENT_BYTES} bytes; these experts run one "
                "after another",
                stacklevel=2,
            )

    def forward(
        self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor
    ) -> tuple[Tensor, None]:
        """Args: tokens sorted by local expert [tokens, hidden], tokens per local expert
        [experts] (any device), each token's router weight [tokens]. Returns ``([tokens,
        hidden], None)``."""
        if not self.grouped or self.num_local_experts == 1:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        offsets = tokens_per_expert.to(device=x.device, dtype=torch.int32).cumsum(
            0, dtype=torch.int32
        )
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        hidden = _GroupedLinear.apply(x, offsets, *fc1)
        hidden = self._weighted_activation(hidden, permuted_probs.unsqueeze(-1))
        return _GroupedLinear.apply(hidden, offsets, *fc2), None

    def _weighted_activation(self, x: Tensor, probs: Tensor) -> Tensor:
        """The experts' activation times each token's router weight, as megatron's ``MLP``
        computes it for one expert (fused SwiGLU where the config asks for it)."""
        config = self.config
        if config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(x, None, probs, config.activation_func_fp8_input_store)
        if config.gated_linear_unit:
            gate, linear = torch.chunk(x, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate = gate.clamp(min=None, max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            x = config.activation_func(gate) * (linear + config.glu_linear_offset)
        else:
            x = config.activation_func(x)
        return (x * probs).to(x.dtype)
