"""Helpers of the tests that drive one in-process Megatron rank (no Ray)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_bridge.parallel_state import destroy_megatron_parallel, find_free_port
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker


@contextmanager
def one_rank_env() -> Iterator[None]:
    """The environment of a world-size-1 Megatron rank (a free port); the process groups
    built inside are torn down on exit."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(find_free_port())}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        try:
            yield
        finally:
            destroy_megatron_parallel()


def decoder_hidden_states(model_path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S, h]`` float32 last hidden states (after the final norm) of transformers' decoder
    of ``model_path`` on ``input_ids``: the oracle of a scalar head's outputs."""
    from transformers import AutoModel

    decoder = AutoModel.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return decoder(input_ids=input_ids).last_hidden_state


@contextmanager
def one_rank_worker(
    model_path: Path,
    batch_size: int,
    seq: int,
    config: dict[str, Any] | None = None,
    **worker_kwargs: Any,
) -> Iterator[MegatronPolicyWorker]:
    """A world-size-1 worker on ``model_path`` (global batch ``batch_size``, micro-batches of
    2, sequences up to ``seq``, other ``policy`` keys from ``config``); its process groups are
    torn down on exit."""
    with one_rank_env():
        cfg = small_policy_config(model_path, batch_size, seq, config)
        yield MegatronPolicyWorker(cfg, str(model_path), init_reference_model=False, **worker_kwargs)


def small_policy_config(
    model_path: Path, batch_size: int, seq: int, config: dict[str, Any] | None = None
) -> PolicyConfig:
    """The ``policy`` config of :func:`one_rank_worker` (global batch ``batch_size``,
    micro-batches of 2, sequences up to ``seq``, other keys from ``config``), also for a
    Ray-placed ``Policy`` compared with it."""
    return PolicyConfig(
        model_name=str(model_path),
        train_global_batch_size=batch_size,
        train_micro_batch_size=2,
        logprob_batch_size=2,
        max_total_sequence_length=seq,
        **(config or {}),
    )


def token_batch(lengths: Sequence[int], seq: int) -> BatchedDataDict:
    """Random token rows of ``lengths`` padded with 0 to ``seq``; the loss's tokens are 1 ..
    length - 1 of every row."""
    gen = torch.Generator().manual_seed(0)
    lengths_t = torch.tensor(lengths)
    t = torch.arange(seq)[None, :]
    ids = torch.randint(1, 1000, (len(lengths), seq), generator=gen)
    ids[t >= lengths_t[:, None]] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths_t,
        token_mask=((t >= 1) & (t < lengths_t[:, None])).float(),
        sample_mask=torch.ones(len(lengths)),
    )
