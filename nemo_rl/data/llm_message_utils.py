"""Batching of message logs: the prompt collate function and flattening to padded tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_rl.data.interfaces import DatumSpec, LLMMessageLogType
from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def rl_collate_fn(data: Sequence[DatumSpec]) -> BatchedDataDict:
    """Stack DatumSpecs into one batch of ``B = len(data)`` rows.

    Returns:
        BatchedDataDict with ``message_log`` (list of B logs), ``length`` ``[B]`` int64 tokens,
        ``extra_env_info`` (list), ``loss_multiplier`` ``[B]`` float32, ``idx`` (list of int),
        ``task_name`` (list of str) and ``stop_strings`` (list, None where unset).
    """
    if not data:
        raise ValueError("rl_collate_fn got an empty batch")
    return BatchedDataDict(
        message_log=[d["message_log"] for d in data],
        length=torch.tensor([d["length"] for d in data], dtype=torch.int64),
        extra_env_info=[d["extra_env_info"] for d in data],
        loss_multiplier=torch.tensor([d["loss_multiplier"] for d in data], dtype=torch.float32),
        idx=[d["idx"] for d in data],
        task_name=[d["task_name"] for d in data],
        stop_strings=[d.get("stop_strings") for d in data],
    )


def message_logs_to_flat(
    message_logs: Sequence[LLMMessageLogType], pad_token_id: int
) -> BatchedDataDict:
    """Concatenate each conversation's messages into one right-padded row.

    Args:
        message_logs: B conversations.
        pad_token_id: id written after each row's last token.

    Returns:
        BatchedDataDict with, for ``S`` = the longest conversation (tokens):
        ``input_ids`` ``[B, S]`` int64 (padded with ``pad_token_id``), ``input_lengths`` ``[B]``
        int64, ``token_mask`` ``[B, S]`` int64 (1 on assistant tokens, 0 elsewhere and on
        padding) and ``generation_logprobs`` ``[B, S]`` float32 (an assistant message's
        generation logprobs, 0 where it has none, elsewhere and on padding).
    """
    if not message_logs:
        raise ValueError("message_logs_to_flat got no message logs")
    lengths = [sum(int(m["token_ids"].numel()) for m in log) for log in message_logs]
    batch, seq = len(message_logs), max(max(lengths), 1)
    input_ids = torch.full((batch, seq), pad_token_id, dtype=torch.int64)
    token_mask = torch.zeros((batch, seq), dtype=torch.int64)
    logprobs = torch.zeros((batch, seq), dtype=torch.float32)
    for row, log in enumerate(message_logs):
        start = 0
        for message in log:
            ids = message["token_ids"]
            end = start + int(ids.numel())
            input_ids[row, start:end] = ids
            if message["role"] == "assistant":
                token_mask[row, start:end] = 1
                if "generation_logprobs" in message:
                    lp = message["generation_logprobs"]
                    if lp.numel() != ids.numel():
                        raise ValueError(
                            f"row {row}: an assistant message has {ids.numel()} tokens but "
                            f"{lp.numel()} generation_logprobs"
                        )
                    logprobs[row, start:end] = lp
            start = end
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.tensor(lengths, dtype=torch.int64),
        token_mask=token_mask,
        generation_logprobs=logprobs,
    )
