"""The policy's GPT layer specs with context-parallel attention, and the CP split of inputs
and outputs.

The specs are the bridge's (:mod:`megatron_bridge.layer_spec`: the spec of a model stage,
matching the HF checkpoint's biases) with the local attention kernel made context parallel.

With TransformerEngine importable (GPU machines) megatron's TE spec is used: it has its own
context-parallel attention. Without it the local spec is used with its ``core_attention``
swapped for :class:`ContextParallelDotProductAttention`, which adds context parallelism and
packed sequences and runs torch's fused attention kernel where the mask allows.

Under CP every rank feeds the model its two chunks of each sequence (see
:func:`split_for_context_parallel`) and gets back per-token outputs (logits, logprobs) for those
tokens only; :func:`gather_from_context_parallel` reassembles them in sequence order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_bridge.cpu_compat import import_megatron_core

import_megatron_core()  # before megatron-core's first import: defers its compiles on CPU

from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_bridge.layer_spec import gpt_stage_spec, resolve_use_te
from nemo_rl.models.megatron.context_parallel_attention import (
    ContextParallelDotProductAttention,
    context_parallel_positions,
)


def get_gpt_layer_spec(use_te: bool | None = None, qk_layernorm: bool = False) -> ModuleSpec:
    """The transformer-layer spec for a dense GPT model.

    Args:
        use_te: use TransformerEngine modules; None picks them when TransformerEngine is
            importable. True without TransformerEngine raises.
        qk_layernorm: apply layer norm to queries and keys.

    Raises:
        ValueError: ``use_te=True`` but TransformerEngine is not installed.
    """
    if resolve_use_te(use_te):
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
    return spec


def get_gpt_stage_spec(
    config: Any, use_te: bool | None = None, grouped_experts: bool = False
) -> Any:
    """The spec of this pipeline stage's layers for a model of ``config``: the bridge's
    :func:`~megatron_bridge.layer_spec.gpt_stage_spec` (dense or mixture-of-experts,
    TransformerEngine or local), the local spec's attention being
    :class:`ContextParallelDotProductAttention`.

    Args:
        config: the model's megatron ``TransformerConfig``.
        use_te: as :func:`get_gpt_layer_spec`.
        grouped_experts: experts as grouped GEMMs (``megatron_cfg.moe_grouped_gemm``).
    """
    return gpt_stage_spec(
        config,
        use_te,
        core_attention=ContextParallelDotProductAttention,
        grouped_experts=grouped_experts,
    )


def split_for_context_parallel(
    tensor: Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1
) -> Tensor:
    """This CP rank's share of ``tensor``: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``.

    Args:
        tensor: e.g. token ids or position ids [batch, seq]; any shape with a sequence
            dimension ``seq_dim`` whose length is divisible by ``2 * cp_size``.
        cp_size: context-parallel size (1 returns ``tensor`` unchanged).
        cp_rank: this rank's index in the CP group.
        seq_dim: index of the sequence dimension.

    Returns:
        ``tensor`` with ``seq / cp_size`` entries along ``seq_dim`` (a copy when cp_size > 1).

    Raises:
        ValueError: sequence length not divisible by ``2 * cp_size`` (pad it), bad rank.
    """
    if cp_size == 1:
        return tensor
    index = context_parallel_positions(tensor.size(seq_dim), cp_size, cp_rank)
    return tensor.index_select(seq_dim, index.to(tensor.device))


def gather_from_context_parallel(
    tensor: Tensor, group: dist.ProcessGroup, seq_dim: int = 1
) -> Tensor:
    """Inverse of :func:`split_for_context_parallel`: the full sequence on every CP rank.

    Not differentiable; meant for outputs (logits, logprobs) after the forward pass.

    Args:
        tensor: this rank's share, e.g. logits [batch, seq / cp, vocab] or logprobs
            [batch, seq / cp]; same shape on every rank of ``group``.
        group: the context-parallel process group (None or size 1 returns ``tensor``).
        seq_dim: index of the sequence dimension.

    Returns:
        ``tensor`` with the full ``seq`` entries along ``seq_dim``, in sequence order.
    """
    cp_size = 1 if group is None else group.size()
    if cp_size == 1:
        return tensor
    seq_dim = seq_dim % tensor.dim()
    local = tensor.contiguous()
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local, group=group)
    seq_len = local.size(seq_dim) * cp_size
    positions = torch.cat(
        [context_parallel_positions(seq_len, cp_size, rank) for rank in range(cp_size)]
    )
    full = torch.empty(
        (*local.shape[:seq_dim], seq_len, *local.shape[seq_dim + 1 :]),
        dtype=local.dtype,
        device=local.device,
    )
    return full.index_copy_(seq_dim, positions.to(local.device), torch.cat(parts, dim=seq_dim))
