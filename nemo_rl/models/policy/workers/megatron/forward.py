"""Forward pass of micro-batches: model inputs -> vocab-parallel logits -> logprobs ``[B, S]``.

Two input layouts:

* padded: ``input_ids`` ``[B, S]`` fed as is (right padding is harmless under causal
  attention);
* packed: the B samples concatenated into one row ``[1, T]``, each padded to a multiple of
  ``2 * CP`` tokens, described by ``PackedSeqParams`` (``qkv_format="thd"``, ``cu_seqlens``).

Under context parallelism (CP) each rank feeds the model its two chunks of every sequence
(megatron's ``2 * CP`` chunk layout, per sequence when packed). A token's logits then predict a
token that may live on another rank, so each rank scores the *next* token of each of its
positions, the CP ranks all-gather those scores (differentiably: the backward keeps the local
positions' gradient, since every CP rank computes the same loss from the gathered tensor),
and the result is shifted into the :mod:`nemo_rl.distributed.model_utils` convention.

Output convention everywhere: ``logprobs[i, t] = log p(input_ids[i, t] | input_ids[i, :t])``
for ``1 <= t < input_lengths[i]``, 0 at ``t = 0`` and at ``t >= input_lengths[i]``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nemo_rl.distributed.fused_lm_head import token_logprobs
from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs, masked_logprobs
from nemo_rl.distributed.sampling import PLAIN_SAMPLING, TrainingSamplingParams
from nemo_rl.models.megatron.context_parallel_attention import context_parallel_positions

# Sequence positions scored at once by from_parallel_logits_to_logprobs: bounds its
# temporaries to [batch, chunk, vocab / TP].
LOGPROB_CHUNK_SIZE = 1024


@dataclass
class ModelInputs:
    """One micro-batch in the model's layout on this rank.

    Attributes:
        input_ids: ``[b, s / CP]`` (padded) or ``[1, T / CP]`` (packed) token ids, CP-local.
        position_ids: same shape as ``input_ids``: each token's position in its sequence.
        packed_seq_params: ``thd`` description of the pack, None when padded.
        next_targets: CP > 1 only: the id of the token following each local token (0 past the
            end), same shape as ``input_ids``.
        local_positions: CP > 1 only: ``[T_local]`` positions of the local tokens in the full
            (pre-split) model row.
        all_positions: CP > 1 only: ``[T_full]`` local positions of every CP rank, in rank order.
        lengths: ``[B]`` real sample lengths (tokens).
        seq_len: ``S``, sequence dimension of the micro-batch's ``[B, S]`` tensors.
        full_len: tokens per model row before the CP split (padded ``s`` or pack ``T``).
        sample_offsets: packed only: ``[B]`` start of each sample in the pack.
        padding_mask: same shape as ``input_ids``, bool: True where the model row holds no
            real token (right padding, the padding to a multiple of ``2 * CP`` / TP, a pack's
            padding between samples). Mixture-of-experts routers leave those tokens out of
            their auxiliary losses (megatron-core's ``padding_mask``).
    """

    input_ids: Tensor
    position_ids: Tensor
    packed_seq_params: Any
    next_targets: Tensor | None
    local_positions: Tensor | None
    all_positions: Tensor | None
    lengths: Tensor
    seq_len: int
    full_len: int
    sample_offsets: Tensor | None
    padding_mask: Tensor


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _cp_positions(segments: Sequence[tuple[int, int]], cp: int, rank: int) -> Tensor:
    """Positions (in the full row) a CP rank holds: its chunks of every ``(start, length)``."""
    return torch.cat(
        [start + context_parallel_positions(length, cp, rank) for start, length in segments]
    )


def build_model_inputs(
    mb: dict[str, Tensor], packed: bool, cp_size: int, cp_rank: int, sp_size: int = 1
) -> ModelInputs:
    """The model inputs of micro-batch ``mb`` (``input_ids`` ``[B, S]``, ``input_lengths``).

    Padded rows are extended to a multiple of ``2 * CP`` tokens (unchanged without CP);
    packed samples are each padded to a multiple of ``2 * CP`` and concatenated. Under
    sequence parallelism (``sp_size`` = TP, 1 without it) every CP rank's share of a row must
    also split into ``sp_size`` equal parts: padded rows are extended, and a pack's last sample
    padded further, until the row's length is a multiple of ``CP * sp_size`` as well.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    ids = mb["input_ids"]
    lengths = mb["input_lengths"].to(torch.long).cpu()
    batch, seq = ids.shape
    # The packed-sequence attention cuts every sequence into 2 * CP chunks, also at CP = 1.
    multiple = 2 * cp_size if cp_size > 1 or packed else 1
    row_multiple = math.lcm(multiple, cp_size * sp_size)
    params = None
    offsets = None
    if packed:
        padded = [_round_up(int(n), multiple) for n in lengths]
        padded[-1] += _round_up(sum(padded), row_multiple) - sum(padded)
        offsets = torch.tensor([0, *padded[:-1]]).cumsum(0)
        full_len = sum(padded)
        row = ids.new_zeros(1, full_len)
        positions = torch.zeros(1, full_len, dtype=torch.long)
        for i, (start, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
            row[0, start : start + n] = ids[i, :n]
            positions[0, start : start + padded[i]] = torch.arange(padded[i])
        segments = list(zip(offsets.tolist(), padded))
        real = torch.zeros(1, full_len, dtype=torch.bool)
        for start, n in zip(offsets.tolist(), lengths.tolist()):
            real[0, start : start + n] = True
        cu_real = torch.tensor([0, *lengths.tolist()]).cumsum(0).to(torch.int32)
        cu_padded = torch.tensor([0, *padded]).cumsum(0).to(torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_real.to(ids.device),
            cu_seqlens_kv=cu_real.to(ids.device),
            cu_seqlens_q_padded=cu_padded.to(ids.device),
            cu_seqlens_kv_padded=cu_padded.to(ids.device),
            max_seqlen_q=max(padded),
            max_seqlen_kv=max(padded),
        )
        ids = row
    else:
        full_len = _round_up(seq, row_multiple)
        if full_len > seq:
            ids = torch.cat([ids, ids.new_zeros(batch, full_len - seq)], dim=1)
        positions = torch.arange(full_len).unsqueeze(0).expand(batch, full_len)
        segments = [(0, full_len)]
        real = torch.arange(full_len)[None, :] < lengths[:, None]
    positions = positions.to(ids.device)
    padding = (~real).to(ids.device)
    if cp_size == 1:
        return ModelInputs(
            ids, positions, params, None, None, None, lengths, seq, full_len, offsets, padding
        )
    next_ids = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)
    local = _cp_positions(segments, cp_size, cp_rank).to(ids.device)
    everyone = torch.cat([_cp_positions(segments, cp_size, r) for r in range(cp_size)])
    return ModelInputs(
        ids.index_select(1, local),
        positions.index_select(1, local),
        params,
        next_ids.index_select(1, local),
        local,
        everyone.to(ids.device),
        lengths,
        seq,
        full_len,
        offsets,
        padding.index_select(1, local),
    )


class _GatherContextParallel(torch.autograd.Function):
    """All-gather per-token values ``[b, t_local]`` of the CP ranks into the full row
    ``[b, t_full]``; the backward returns the gradient of this rank's positions (each CP rank
    computes the same loss from the full row, so the gradient is not summed)."""

    @staticmethod
    def forward(ctx, local: Tensor, local_pos: Tensor, all_pos: Tensor, group: Any) -> Tensor:
        ctx.save_for_backward(local_pos)
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local, group=group)
        full = local.new_zeros(local.shape[0], all_pos.numel())
        return full.index_copy_(1, all_pos, torch.cat(parts, dim=1))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (local_pos,) = ctx.saved_tensors
        return grad.index_select(1, local_pos), None, None, None


def _tp_vocab_range(width: int) -> tuple[Any, int]:
    """``(tp_group, first token id)`` of this TP rank's ``width`` vocabulary rows."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_rank() * width,
    )


def logprobs_from_logits(
    logits: Tensor,
    inputs: ModelInputs,
    inference_only: bool,
    sampling: TrainingSamplingParams = PLAIN_SAMPLING,
) -> Tensor:
    """``[B, S]`` float32 logprobs of the micro-batch's tokens from this rank's logits.

    Args:
        logits: ``[b, t_local, V / TP]`` vocab-parallel logits of this TP rank.
        inputs: what :func:`build_model_inputs` made for the same micro-batch.
        inference_only: build no autograd graph.
        sampling: the distribution scored (:mod:`nemo_rl.distributed.sampling`): logits
            divided by its temperature, then top-k / top-p truncated and renormalised; a
            token outside the kept set scores ``-inf``.
    """
    width = logits.shape[-1]
    tp_group, start = _tp_vocab_range(width)
    vocab = (start, start + width)
    logits = logits.float() if logits.dtype != torch.float32 else logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature

    def score(scored_logits: Tensor, targets: Tensor) -> Tensor:
        if not sampling.truncates:
            return from_parallel_logits_to_logprobs(
                scored_logits, targets, *vocab, tp_group, inference_only, LOGPROB_CHUNK_SIZE
            )
        with torch.no_grad() if inference_only else contextlib.nullcontext():
            return masked_logprobs(
                scored_logits, targets, *vocab, tp_group, sampling.top_k, sampling.top_p,
                widen=True,
            )

    if inputs.next_targets is None:
        return _to_batch_layout(score(logits, inputs.input_ids), inputs)
    # Score the next token of every local position: put a dummy position in front so the
    # function's "target t from logits t-1" rule pairs logits[i] with next_targets[i].
    b = logits.shape[0]
    padded_logits = torch.cat([logits, logits.new_zeros(b, 1, width)], dim=1)
    targets = torch.cat([inputs.next_targets.new_zeros(b, 1), inputs.next_targets], dim=1)
    next_local = score(padded_logits, targets)[:, 1:]
    return _from_next_token_scores(next_local, inputs)


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    vocab_start: int,
    inputs: ModelInputs,
    inference_only: bool,
    chunk_size: int,
    sampling: TrainingSamplingParams = PLAIN_SAMPLING,
) -> Tensor:
    """:func:`logprobs_from_logits` with the LM head fused in
    (:func:`~nemo_rl.distributed.fused_lm_head.token_logprobs`): the same ``[B, S]`` float32
    logprobs, the logits formed ``chunk_size`` tokens at a time. Without CP only the scored
    tokens (``1 <= t < input_lengths``) go through the LM head.

    Args:
        hidden: ``[b, t_local, h]`` the output layer's input on this rank
            (:func:`~nemo_rl.models.megatron.lm_head.output_layer_returns_hidden`).
        weight: ``[tokens, h]`` this rank's LM-head rows that are tokens (no vocabulary
            padding: :func:`~nemo_rl.models.megatron.lm_head.output_weight`).
        vocab_start: the token id of ``weight``'s first row.
        inputs: what :func:`build_model_inputs` made for the same micro-batch.
        inference_only: build no autograd graph.
        chunk_size: tokens whose logits exist at once.
        sampling: the distribution scored, as in :func:`logprobs_from_logits`.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    h = hidden.shape[-1]
    if inputs.next_targets is not None:
        b, t_local = inputs.next_targets.shape
        next_local = token_logprobs(
            hidden.reshape(-1, h), weight, inputs.next_targets.reshape(-1), vocab_start, tp_group,
            chunk_size, inference_only, sampling,
        ).view(b, t_local)
        return _from_next_token_scores(next_local, inputs)
    rows, cols, model_rows, model_cols = _scored_tokens(inputs, hidden.device)
    values = token_logprobs(
        hidden[model_rows, model_cols - 1], weight, inputs.input_ids[model_rows, model_cols],
        vocab_start, tp_group, chunk_size, inference_only, sampling,
    )
    out = values.new_zeros(inputs.lengths.numel(), inputs.seq_len)
    return out.index_put((rows, cols), values)


def _scored_tokens(inputs: ModelInputs, device: torch.device) -> tuple[Tensor, ...]:
    """``(rows, cols)`` in ``[B, S]`` of every scored token (``1 <= t < input_lengths``) and
    ``(model_rows, model_cols)``: where that token sits in the model's (non-CP) layout."""
    t = torch.arange(inputs.seq_len, device=device)
    lengths = inputs.lengths.to(device)
    rows, cols = ((t[None, :] >= 1) & (t[None, :] < lengths[:, None])).nonzero(as_tuple=True)
    if inputs.sample_offsets is None:
        return rows, cols, rows, cols
    return rows, cols, torch.zeros_like(rows), inputs.sample_offsets.to(device)[rows] + cols


def _from_next_token_scores(next_local: Tensor, inputs: ModelInputs) -> Tensor:
    """CP > 1: ``[b, t_local]`` scores of each local token's next token -> ``[B, S]``."""
    from megatron.core import parallel_state

    b = next_local.shape[0]
    cp_group = parallel_state.get_context_parallel_group()
    next_full = _GatherContextParallel.apply(
        next_local, inputs.local_positions, inputs.all_positions, cp_group
    )
    row = torch.cat([next_full.new_zeros(b, 1), next_full[:, :-1]], dim=1)
    return _to_batch_layout(row, inputs)


def _to_batch_layout(row: Tensor, inputs: ModelInputs) -> Tensor:
    """Model-layout logprobs (``[b, full_len]`` or ``[1, T]``) -> ``[B, S]``, masked."""
    seq = inputs.seq_len
    t = torch.arange(seq, device=row.device)
    lengths = inputs.lengths.to(row.device)
    valid = (t[None, :] >= 1) & (t[None, :] < lengths[:, None])
    if inputs.sample_offsets is None:
        out = row[:, :seq]
    else:
        index = (inputs.sample_offsets.to(row.device)[:, None] + t[None, :]).clamp(
            max=row.shape[1] - 1
        )
        out = row[0][index]
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def rewards_from_outputs(values: Tensor, inputs: ModelInputs) -> Tensor:
    """``[B]`` float32 rewards: a scalar head's value at each row's last real token.

    Args:
        values: ``[b, t_local, 1]`` outputs of the model's scalar head (the same on every TP
            rank), CP-local.
        inputs: what :func:`build_model_inputs` made for the same micro-batch.
    """
    from megatron.core import parallel_state

    row = values[..., 0].float()
    if inputs.local_positions is not None:
        row = _GatherContextParallel.apply(
            row, inputs.local_positions, inputs.all_positions,
            parallel_state.get_context_parallel_group(),
        )
    last = inputs.lengths.to(row.device) - 1
    if inputs.sample_offsets is None:
        return row[torch.arange(last.numel(), device=row.device), last]
    return row[0, inputs.sample_offsets.to(row.device) + last]


def values_from_outputs(values: Tensor, inputs: ModelInputs) -> Tensor:
    """``[B, S]`` float32 per-token values of a critic: at position ``t`` the scalar head's
    output at position ``t - 1`` (the state from which token ``t`` is generated), aligned like
    :func:`logprobs_from_logits`' output; 0 at position 0 and past each row's length.

    Args:
        values: ``[b, t_local, 1]`` outputs of the model's scalar head (the same on every TP
            rank), CP-local.
        inputs: what :func:`build_model_inputs` made for the same micro-batch.
    """
    from megatron.core import parallel_state

    if values.shape[-1] != 1:
        raise ValueError(
            f"per-token values need the scalar head (reward_model_cfg.enabled), got outputs "
            f"of width {values.shape[-1]}"
        )
    row = values[..., 0].float()
    if inputs.local_positions is not None:
        row = _GatherContextParallel.apply(
            row, inputs.local_positions, inputs.all_positions,
            parallel_state.get_context_parallel_group(),
        )
    shifted = torch.cat([row.new_zeros(row.shape[0], 1), row[:, :-1]], dim=1)
    return _to_batch_layout(shifted, inputs)


def sequence_parallel_share(mask: Tensor, sp_size: int, sp_rank: int) -> Tensor:
    """The positions ``[b, t_local / sp_size]`` of a CP-local ``[b, t_local]`` tensor that
    TP rank ``sp_rank`` holds under sequence parallelism (megatron splits the sequence into
    ``sp_size`` contiguous parts); ``mask`` itself when ``sp_size`` is 1."""
    width = mask.shape[1] // sp_size
    return mask[:, sp_rank * width : (sp_rank + 1) * width]


def _stage_padding_mask(mb: ModelInputs, config: Any) -> Tensor:
    """The padding mask a pipeline stage takes: the CP-local row on the first stage (GPTModel
    splits it over the TP ranks itself under sequence parallelism), this TP rank's part on
    the later ones (GPTModel hands theirs to the layers as given)."""
    from megatron.core import parallel_state

    if parallel_state.is_pipeline_first_stage() or not config.sequence_parallel:
        return mb.padding_mask
    return sequence_parallel_share(
        mb.padding_mask,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def run_micro_batches(
    model: Any,
    inputs: list[ModelInputs],
    forward_only: bool,
    on_logits: Callable[[int, Tensor], tuple[Tensor, dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Run ``inputs`` through the (pipelined) model with megatron's schedule; every
    micro-batch with its :attr:`ModelInputs.padding_mask`.

    Args:
        model: the DDP-wrapped (or bare) GPTModel stage.
        inputs: one entry per micro-batch, in order; every PP stage passes the same list.
        forward_only: no backward pass.
        on_logits: last stage only: ``(micro-batch index, logits) -> (loss, outputs)``; the
            loss (a scalar, already globally normalised) is back-propagated when training.

    Returns:
        On the last PP stage the ``outputs`` of every micro-batch in order; [] elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    order = iter(range(len(inputs)))

    def forward_step(_data_iterator: Any, stage: Any) -> tuple[Tensor, Callable]:
        index = next(order)
        mb = inputs[index]
        output = stage(
            mb.input_ids,
            mb.position_ids,
            attention_mask=None,
            packed_seq_params=mb.packed_seq_params,
            padding_mask=_stage_padding_mask(mb, stage.config),
        )

        def loss_func(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
            loss, outputs = on_logits(index, logits)
            return loss, torch.ones((), dtype=torch.int), outputs

        return output, loss_func

    first = inputs[0].input_ids
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None] * len(inputs)),
        model=[model],
        num_microbatches=len(inputs),
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
    )


def zero_outside_sampled_set(logprobs: Tensor, mask: Tensor | None, what: str) -> Tensor:
    """``logprobs`` with every ``-inf`` (a token outside the top-k / top-p set of the policy
    that scores it) replaced by 0, as NeMo RL does: such a token adds nothing to the loss's
    gradient. The engine sampled it from its own truncated set, so at a valid position this
    means the trainer's set differs at its edge (float noise, or a policy that has moved since
    the rollout): a warning counts those under ``mask``.

    Args:
        logprobs: ``[B, S]`` logprobs (any device).
        mask: ``[B, S]`` positions that were sampled and are trained on (``token_mask`` times
            ``sample_mask``); None: count none.
        what: the logprobs' name, for the warning.
    """
    outside = torch.isneginf(logprobs)
    if mask is not None:
        count = int((outside & (mask.to(outside.device) > 0)).sum())
        if count:
            logging.getLogger(__name__).warning(
                "%d of %d sampled tokens lie outside the policy's top-k/top-p set in %s "
                "(the trainer's truncated set differs from the engine's there); they score 0 "
                "and add no gradient", count, int((mask > 0).sum()), what,
            )
    return torch.where(outside, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device), logprobs)
