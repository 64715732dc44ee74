"""Core attention with context parallelism (CP) that runs without TransformerEngine.

megatron-core's local ``DotProductAttention`` refuses ``context_parallel_size > 1``; only
TransformerEngine's attention implements CP, and TransformerEngine needs CUDA. This module is a
drop-in ``core_attention`` for the local layer spec that supports CP on any backend (gloo on the
CPU, nccl on GPUs).

Layout (the one megatron's rotary embeddings and TransformerEngine use): the full sequence of
``S`` tokens is cut into ``2 * CP`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2 * CP - 1 - r``, so every rank gets the same share of causal-attention work. For packed
sequences (``thd``) the same cut is applied to every sequence of the pack separately.

On one rank (CP size 1) plain causal attention, packed or not, runs torch's fused kernels
(``scaled_dot_product_attention``; packs: :mod:`nemo_rl.models.megatron.packed_attention`, the
varlen flash-attention kernel on CUDA): no ``[S, S]`` scores are materialised, and packs cost
the sum of their sequences' squared lengths, not the pack's.

Algorithm under CP (and for masks the fused kernel does not take): all-gather K and V over the
CP group (their backward reduce-scatters the gradients), then compute plain softmax attention
of the local queries against all keys. The mask is built
from the global position (and sequence id, when packed) of every query and key token, so the
gathered keys need no reordering. Scores for ``[batch, heads, S / CP, S]`` are materialised:
memory grows with ``S**2 / CP``, which suits tests and moderate lengths, not long-context runs
(use TransformerEngine's ring attention there).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_bridge.cpu_compat import import_megatron_core

import_megatron_core()  # before megatron-core's first import: defers its compiles on CPU

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.fusions.fused_softmax import SoftmaxOne
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide

from nemo_rl.models.megatron.packed_attention import packed_causal_attention

# Score written into masked positions before the softmax; megatron's local attention uses the
# same finite value, so a fully masked row yields a uniform distribution instead of NaN.
_MASKED_SCORE = -10000.0


def context_parallel_positions(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """Global positions of the tokens a CP rank holds, in its local order.

    Args:
        seq_len: full sequence length in tokens; must be divisible by ``2 * cp_size``.
        cp_size: context-parallel size.
        cp_rank: this rank's index in the CP group, in [0, cp_size).

    Returns:
        int64 tensor [seq_len / cp_size]: positions of chunk ``cp_rank`` followed by those of
        chunk ``2 * cp_size - 1 - cp_rank`` (chunks of ``seq_len / (2 * cp_size)`` tokens).

    Raises:
        ValueError: ``seq_len`` not divisible by ``2 * cp_size`` or ``cp_rank`` out of range.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp_size}: "
            f"pad the sequence to a multiple of 2*cp"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk)
    return torch.cat([first, second])


def _reduce_scatter_first_dim(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum ``tensor`` [n * size, ...] over ``group`` and return this rank's slice [n, ...].

    gloo has no reduce-scatter, so there it is an all-reduce followed by a slice.
    """
    size = group.size()
    rank = group.rank()
    tensor = tensor.contiguous()
    if dist.get_backend(group) == dist.Backend.GLOO:
        dist.all_reduce(tensor, group=group)
        return tensor.chunk(size, dim=0)[rank].contiguous()
    out = torch.empty(
        (tensor.size(0) // size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    dist.reduce_scatter_tensor(out, tensor, group=group)
    return out


class _AllGatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0 in rank order; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(group.size())]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _reduce_scatter_first_dim(grad, ctx.group), None


def all_gather_context_parallel(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Differentiable all-gather of ``tensor`` [n, ...] into [n * group.size(), ...], rank order."""
    return _AllGatherFirstDim.apply(tensor, group)


def _token_layout(
    cu_seqlens_padded: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence id, position and validity of each token a CP rank holds of a packed batch.

    Args:
        cu_seqlens_padded: int [num_seqs + 1], cumulative padded lengths of the full pack.
        cu_seqlens: int [num_seqs + 1], cumulative real (unpadded) lengths.
        cp_size: context-parallel size.
        cp_rank: rank whose tokens are described.

    Returns:
        (seq_ids, positions, valid), each [tokens on this rank]: the sequence each token
        belongs to, its position inside that sequence, and whether it is a real token.
    """
    padded_lens = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).tolist()
    real_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    seq_ids, positions, valid = [], [], []
    for seq_id, (padded_len, real_len) in enumerate(zip(padded_lens, real_lens)):
        pos = context_parallel_positions(padded_len, cp_size, cp_rank)
        seq_ids.append(torch.full_like(pos, seq_id))
        positions.append(pos)
        valid.append(pos < real_len)
    return torch.cat(seq_ids), torch.cat(positions), torch.cat(valid)


class ContextParallelDotProductAttention(MegatronModule):
    """Softmax attention over [seq, batch, heads, head_dim] inputs with optional CP.

    Same constructor and forward signature as megatron-core's ``DotProductAttention``; at CP
    size 1 and unpacked inputs it computes the same function (fp32: equal to rounding).
    Supports causal, padding and sliding-window masks, grouped-query attention, the
    off-by-one / learnable softmax offsets and packed (``thd``) sequences.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # cp_comm_type selects among TransformerEngine's CP algorithms; this module always
        # all-gathers K and V, so any value is accepted and computes the same result.

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        if not hasattr(pg_collection, "tp"):
            raise ValueError("pg_collection must have a 'tp' process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_group is None and config.context_parallel_size > 1:
            self.cp_group = parallel_state.get_context_parallel_group()
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size ({config.context_parallel_size}) differs from the "
                f"size of the CP process group ({cp_size}): initialise megatron's parallel state "
                f"with the same context_parallel_size"
            )

        tp_size = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.softmax_scale = softmax_scale
        # With query-key layer scaling the scores are divided by the layer number before the
        # matmul (fp16 range) and multiplied back inside the fp32 softmax, as megatron does.
        self.score_coeff: Optional[float] = None
        if config.apply_query_key_layer_scaling:
            self.score_coeff = float(self.layer_number)
            self.softmax_scale /= self.score_coeff

        self.window_size: Optional[tuple[int, int]] = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            self.window_size = tuple(config.window_size)

        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(
                self.num_attention_heads_per_partition,
                device=torch.cuda.current_device(),
                dtype=config.params_dtype,
            )
        elif config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(
                    self.num_attention_heads_per_partition,
                    device=torch.cuda.current_device(),
                    dtype=config.params_dtype,
                )
            )
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        else:
            raise ValueError(
                f"config.softmax_type {config.softmax_type!r} is not supported: use 'vanilla', "
                f"'off-by-one' or 'learnable'"
            )

    @property
    def cp_size(self) -> int:
        """Context-parallel size (1 without a CP group)."""
        return 1 if self.cp_group is None else self.cp_group.size()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Attention of the local queries against the keys of the whole (CP-gathered) sequence.

        Args:
            query: [sq, b, np, hn] (``thd``: [t, np, hn]) — this rank's tokens, CP layout.
            key: [sk, b, ng, hn] (``thd``: [t, ng, hn]); ``ng`` divides ``np`` (GQA).
            value: same shape as ``key``.
            attention_mask: optional bool mask, True = masked, broadcastable to
                [b, np, S, S] over the full sequence of S tokens in sequence order (with CP the
                rows/columns of this rank's queries and of the gathered keys are selected).
                Combined with the causal / sliding-window mask. Not allowed with ``thd``.
            attn_mask_type: overrides the constructor's mask type for this call.
            attention_bias: unsupported, must be None.
            packed_seq_params: ``thd`` packing (``cu_seqlens_q`` and optionally
                ``cu_seqlens_q_padded`` over the full, pre-CP pack; padded lengths divisible
                by 2*CP), or None.

        Returns:
            [sq, b, np * hn] (``thd``: [t, 1, np * hn]) in the dtype of ``query``.
        """
        if attention_bias is not None:
            raise ValueError(
                "attention_bias is not supported by ContextParallelDotProductAttention"
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:
            if attention_mask is not None:
                raise ValueError(
                    "attention_mask must be None with packed (thd) sequences: cu_seqlens "
                    "already define which tokens attend to which"
                )
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)

        if self._causal_kernel_applies(mask_type, attention_mask, query.size(0), key.size(0)):
            return self._causal_sdpa(query, key, value, packed_seq_params if packed else None)

        if self.cp_size > 1:
            # One collective for K and V: [s, 2, b, ng, hn] -> [CP * s, 2, b, ng, hn].
            key, value = all_gather_context_parallel(
                torch.stack([key, value], dim=1), self.cp_group
            ).unbind(1)

        mask = self._build_mask(
            query.size(0),
            key.size(0),
            mask_type,
            attention_mask,
            packed_seq_params if packed else None,
        )
        if mask is not None:
            mask = mask.to(query.device)

        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)

        sq, b, heads, _ = query.shape
        sk = key.size(0)
        # [s, b, np, hn] -> [b * np, s, hn]
        q = query.reshape(sq, b * heads, -1).transpose(0, 1)
        k = key.reshape(sk, b * heads, -1).transpose(0, 1)
        v = value.reshape(sk, b * heads, -1).transpose(0, 1)

        scores = torch.baddbmm(
            torch.empty(b * heads, sq, sk, dtype=q.dtype, device=q.device),
            q,
            k.transpose(1, 2),
            beta=0.0,
            alpha=self.softmax_scale,
        ).view(b, heads, sq, sk)
        probs = self._softmax(scores, mask).to(query.dtype)

        if self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)

        context = torch.bmm(probs.view(b * heads, sq, sk), v)  # [b * np, sq, hn]
        context = context.view(b, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)

    def _causal_kernel_applies(
        self, mask_type: AttnMaskType, attention_mask: Optional[Tensor], sq: int, sk: int
    ) -> bool:
        """True when the attention is plain causal softmax attention on one rank: then torch's
        fused ``scaled_dot_product_attention`` computes it without materialising scores."""
        return (
            self.cp_size == 1
            and sq == sk
            and mask_type == AttnMaskType.causal
            and attention_mask is None
            and self.window_size is None
            and self.score_coeff is None
            and self.softmax_offset is None
            and not (self.training and self.attention_dropout.p > 0)
        )

    def _causal_sdpa(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        packed_seq_params: Optional[PackedSeqParams],
    ) -> Tensor:
        """Causal attention with torch's fused kernels (packed: :mod:`.packed_attention`).

        Args:
            query: [s, b, np, hn] (packed: b = 1, sequences back to back along s).
            key, value: [s, b, ng, hn].
            packed_seq_params: ``thd`` description of the pack (each sequence attends only to
                itself; padding at a sequence's end is after its real tokens, so causal
                attention keeps it out of their outputs), or None.

        Returns:
            [s, b, np * hn] (packed: [s, 1, np * hn]); rows past the last sequence are zero.
        """
        s, b = query.shape[:2]
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            max_len = packed_seq_params.max_seqlen_q or int((cu[1:] - cu[:-1]).max())
            context = packed_causal_attention(
                query[:, 0], key[:, 0], value[:, 0], cu, max_len, self.softmax_scale
            )
            return context.reshape(s, 1, self.hidden_size_per_partition)
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1)
        )
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _softmax(self, scores: Tensor, mask: Optional[Tensor]) -> Tensor:
        """fp32 masked softmax of scores [b, np, sq, sk] over the last dimension."""
        scores = scores.float()
        if self.score_coeff is not None:
            scores = scores * self.score_coeff
        if mask is not None:
            scores = scores.masked_fill(mask, _MASKED_SCORE)
        if self.softmax_offset is None:
            return torch.softmax(scores, dim=-1)
        return SoftmaxOne(-1, self.softmax_offset.to(scores.device).float())(scores)

    def _build_mask(
        self,
        sq: int,
        sk: int,
        mask_type: AttnMaskType,
        attention_mask: Optional[Tensor],
        packed_seq_params: Optional[PackedSeqParams],
    ) -> Optional[Tensor]:
        """Bool mask (True = masked) broadcastable to [b, np, sq, sk], or None for no mask."""
        cp_size = self.cp_size
        cp_rank = 0 if cp_size == 1 else self.cp_group.rank()

        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q.cpu()
            cu_padded = packed_seq_params.cu_seqlens_q_padded
            cu_padded = cu_seqlens if cu_padded is None else cu_padded.cpu()
            q_seq, q_pos, _ = _token_layout(cu_padded, cu_seqlens, cp_size, cp_rank)
            layouts = [
                _token_layout(cu_padded, cu_seqlens, cp_size, rank) for rank in range(cp_size)
            ]
            k_seq = torch.cat([layout[0] for layout in layouts])
            k_pos = torch.cat([layout[1] for layout in layouts])
            k_valid = torch.cat([layout[2] for layout in layouts])
            if q_pos.numel() != sq or k_pos.numel() != sk:
                raise ValueError(
                    f"packed_seq_params describe {q_pos.numel()} local tokens but the query has "
                    f"{sq}: cu_seqlens must cover the full pack before the CP split"
                )
            mask = (q_seq[:, None] != k_seq[None, :]) | ~k_valid[None, :]
        else:
            if cp_size == 1:
                # Queries are the last sq of the sk keys (sq < sk when decoding with a cache).
                k_pos = torch.arange(sk)
                q_pos = k_pos[sk - sq :]
            else:
                seq_len = sq * cp_size
                q_pos = context_parallel_positions(seq_len, cp_size, cp_rank)
                k_pos = torch.cat(
                    [context_parallel_positions(seq_len, cp_size, r) for r in range(cp_size)]
                )
            mask = None

        offset = k_pos[None, :] - q_pos[:, None]  # [sq, sk], key position minus query position
        if self.window_size is not None:
            left, right = self.window_size
            outside = torch.zeros_like(offset, dtype=torch.bool)
            if left >= 0:
                outside |= offset < -left
            if right >= 0:
                outside |= offset > right
            mask = outside if mask is None else mask | outside
        elif mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            future = offset > 0
            mask = future if mask is None else mask | future

        if attention_mask is not None:
            attention_mask = attention_mask.bool()
            if cp_size > 1:
                attention_mask = attention_mask.index_select(
                    -2, q_pos.to(attention_mask.device)
                ).index_select(-1, k_pos.to(attention_mask.device))
            if mask is not None:
                attention_mask = mask.to(attention_mask.device) | attention_mask
            mask = attention_mask
        return mask

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: Optional[dict] = None,
    ) -> ShardedStateDict:
        """Sharded state dict: only the learnable softmax offset, sharded over TP heads."""
        state_dict = (
            self.state_dict(prefix="", keep_vars=True)
            if self.config.softmax_type == "learnable"
            else {}
        )
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
