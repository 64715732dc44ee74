"""Full-vocabulary logits from a (TP/PP-sharded) Megatron GPTModel, for verification.

Every rank calls :func:`megatron_logits` with the same token ids and gets the same
``[batch, seq, vocab]`` logits: TP shards of the vocabulary are gathered, the pipeline is run
with megatron-core's forward-only schedule, and the last stage broadcasts the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_bridge.parallel_state import collective_device


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """All TP ranks' vocabulary slices ``[b, s, V/tp]`` -> ``[b, s, V]`` (padded V)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    logits = logits.contiguous()
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def megatron_logits(model: torch.nn.Module, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits of a causal forward pass over ``input_ids``.

    Args:
        model: this rank's GPTModel stage (eval mode).
        input_ids: ``[batch, seq]`` int64 token ids, identical on every rank.
        vocab_size: real vocabulary size; padding columns are dropped.

    Returns:
        ``[batch, seq, vocab_size]`` float32 logits, identical on every rank.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)

    def forward_step(_data_iterator, stage):
        output = stage(input_ids, position_ids, attention_mask=None)

        def collect(output_tensor: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
            return _gather_vocab(output_tensor)

        return output, collect

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        logits = _gather_vocab(model(input_ids, position_ids, attention_mask=None))
    else:
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
            collect_non_loss_data=True,
        )
        device = collective_device()
        shape = torch.tensor(
            list(outputs[0].shape) if parallel_state.is_pipeline_last_stage() else [0, 0, 0],
            device=device,
        )
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(shape, src=last, group=group)
        if parallel_state.is_pipeline_last_stage():
            logits = outputs[0].contiguous().float()
        else:
            logits = torch.empty(*shape.tolist(), dtype=torch.float32, device=device)
        dist.broadcast(logits, src=last, group=group)
    return logits[..., :vocab_size].float()
