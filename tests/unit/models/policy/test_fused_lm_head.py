"""The LM head fused with the logprobs (``policy.logprob_chunk_size``) against the un-fused
path (the output layer's full logits, then ``from_parallel_logits_to_logprobs``), in float32.

* ``token_logprobs`` alone: logprobs and the gradients of the hidden states and of the weight
  equal the full-logits path's at several chunk sizes, with one rank and at TP=2 over gloo
  (two spawned processes, the vocabulary split in halves).
* The Megatron worker's functions on the tiny models at TP=1 (DP=2), TP=2 and TP=2 with
  sequence parallelism, fused (chunks of 5 tokens) against un-fused: the same logprobs of
  right-padded and of packed micro-batches, the same loss of one NLL training step, and the
  same gradients of every parameter (LM head / tied embedding included). Tolerance: 1e-6
  absolute plus 1e-6 relative (summing per-chunk weight gradients reorders float32 additions).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from layout_ports import gloo_ranks, next_layout_port, run_two_ranks
from megatron_bridge.parallel_state import destroy_megatron_parallel, find_free_port
from nemo_rl.distributed.fused_lm_head import token_logprobs
from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs

TOL = dict(rtol=1e-6, atol=1e-6)
B, S, H, V = 3, 11, 16, 48


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden ``[B, S, H]``, weight ``[V, H]`` (logits of order 1, as a trained LM head's),
    targets ``[B, S]`` and an upstream gradient ``[B, S]``."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, S, H, generator=gen),
        torch.randn(V, H, generator=gen) * 0.3,
        torch.randint(0, V, (B, S), generator=gen),
        torch.randn(B, S, generator=gen),
    )


def _full_logits_path(hidden, weight, targets, grad, start: int, group: Any):
    """The un-fused path: ``[B, S]`` logprobs and the gradients of hidden and weight."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = from_parallel_logits_to_logprobs(
        hidden @ weight.t(), targets, start, start + weight.shape[0], group
    )
    return (out.detach(), *torch.autograd.grad((out * grad).sum(), (hidden, weight)))


def _fused_path(hidden, weight, targets, grad, start: int, group: Any, chunk: int | None):
    """The same through ``token_logprobs`` (position t scored from the hidden state at t-1)."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    n = hidden.shape[0] * (hidden.shape[1] - 1)
    scored = token_logprobs(
        hidden[:, :-1].reshape(n, -1), weight, targets[:, 1:].reshape(n), start, group, chunk
    ).view(hidden.shape[0], -1)
    out = torch.cat([scored.new_zeros(hidden.shape[0], 1), scored], dim=1)
    return (out.detach(), *torch.autograd.grad((out * grad).sum(), (hidden, weight)))


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_one_rank_equals_full_logits(chunk: int | None) -> None:
    hidden, weight, targets, grad = _inputs()
    expected = _full_logits_path(hidden, weight, targets, grad, 0, None)
    got = _fused_path(hidden, weight, targets, grad, 0, None, chunk)
    for name, a, b in zip(("logprobs", "d hidden", "d weight"), got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_inference_only_equals_and_builds_no_graph() -> None:
    hidden, weight, targets, _ = _inputs()
    hidden.requires_grad_()
    out = token_logprobs(hidden[0], weight, targets[0], 0, None, 4, inference_only=True)
    assert out.grad_fn is None and out.dtype == torch.float32
    expected = torch.log_softmax(hidden[0].detach() @ weight.t(), -1)
    torch.testing.assert_close(out, expected.gather(-1, targets[0, :, None])[:, 0], **TOL)


def test_target_outside_the_vocabulary_is_named() -> None:
    hidden, weight, targets, _ = _inputs()
    bad = targets[0].clone()
    bad[2] = V
    with pytest.raises(ValueError, match=rf"target token {V} \(token 2 of {S}\)"):
        token_logprobs(hidden[0], weight, bad, 0, None, 4)


def _tp_rank(rank: int, port: int, out_dir: str) -> None:
    with gloo_ranks(rank, port):
        hidden, weight, targets, grad = _inputs(1)
        half = V // 2
        shard = weight[rank * half : (rank + 1) * half]
        group = dist.group.WORLD
        results = {
            "full": _full_logits_path(hidden, shard, targets, grad, rank * half, group),
            **{
                chunk: _fused_path(hidden, shard, targets, grad, rank * half, group, chunk)
                for chunk in (5, None)
            },
        }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def test_two_tensor_parallel_ranks_equal_full_logits(tmp_path: Path) -> None:
    mp.spawn(_tp_rank, args=(find_free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for chunk in (5, None):
            for name, a, b in zip(("logprobs", "d hidden", "d weight"), results[chunk], results["full"]):
                torch.testing.assert_close(a, b, **TOL, msg=f"rank {rank}, chunk {chunk}: {name}")


# ---------------------------------------------------------------- the Megatron worker's path

GBS, SEQ = 4, 13
LENGTHS = (13, 6, 9, 3)
# name: (model, tp, sequence_parallel); dp2 is a TP=1 model on both ranks
LAYOUTS = {"dp2": ("qwen2", 1, False), "tp2": ("llama", 2, False), "tp2sp": ("qwen2", 2, True)}


def _batch(width: int = SEQ) -> Any:
    """The ``LENGTHS`` rows (the same tokens whatever ``width``), right-padded to ``width``
    columns."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor(LENGTHS)
    positions = torch.arange(width)[None, :]
    ids = torch.zeros(GBS, width, dtype=torch.long)
    ids[:, :SEQ] = torch.randint(3, 1000, (GBS, SEQ), generator=gen)
    ids[positions >= lengths[:, None]] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=((positions >= 1) & (positions < lengths[:, None])).float(),
        sample_mask=torch.ones(GBS),
    )


def _shard(batch: Any, dp: int, rank: int, packed: bool) -> Any:
    if not packed:
        return batch.get_batch(rank, GBS // dp) if dp > 1 else batch
    args = {
        "input_key": "input_ids", "input_lengths_key": "input_lengths",
        "max_tokens_per_microbatch": 16, "sequence_length_round": 1,
        "algorithm": "modified_first_fit_decreasing",
    }
    shards = batch.shard_by_batch_size(dp, batch_size=GBS, sequence_packing_args=args)
    return shards.shards[rank]


def _worker(rank: int, paths: str, out_dir: str, port: int) -> dict[Any, Any]:
    from nemo_rl.algorithms.loss import NLLLoss
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.workers.megatron.model_setup import setup_policy_model
    from nemo_rl.models.policy.workers.megatron.train_step import (
        compute_logprobs,
        iterate_steps,
        micro_batches,
    )

    model_paths = dict(item.split("=", 1) for item in paths.split(","))
    results = {}
    # (layout, chunk, packed, batch width): every layout fused and not, padded and packed;
    # and the padded batch widened by 6 all-padding columns (trimmed away: same results)
    cases = [
        (name, chunk, packed, SEQ)
        for name in LAYOUTS for chunk in (None, 5) for packed in (False, True)
    ] + [("dp2", 5, False, SEQ + 6)]
    for name, chunk, packed, width in cases:
        model, tp, sp = LAYOUTS[name]
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port))
        config = PolicyConfig(
            model_name=model_paths[model],
            train_global_batch_size=GBS,
            train_micro_batch_size=1,
            max_total_sequence_length=width,
            precision="float32",
            logprob_chunk_size=chunk,
            sequence_packing={"enabled": packed},
            megatron_cfg={
                "tensor_model_parallel_size": tp,
                "sequence_parallel": sp,
                "optimizer": {"lr": 1e-3, "min_lr": 1e-3, "clip_grad": 0.0},
            },
        )
        policy = setup_policy_model(config, model_paths[model], seed=3)
        shard = _shard(_batch(width), policy.layout.dp, rank // tp, packed)
        widths = [mb["input_ids"].shape[1] for mb in micro_batches(shard, 2, packed)[0]]
        logprobs = compute_logprobs(policy, shard, 2, packed)
        (step,) = iterate_steps(policy, shard, NLLLoss(), GBS, 2, packed, False)
        grads = {
            n: p.main_grad.detach().clone()
            for n, p in policy.model.module.named_parameters()
        }
        results[name, chunk, packed, width] = dict(
            logprobs=logprobs, loss=step["loss"], grads=grads, widths=widths
        )
        port = next_layout_port()
        destroy_megatron_parallel()
    return results


@pytest.fixture(scope="module")
def worker_results(
    tiny_llama_path: Path, tiny_qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    paths = f"llama={tiny_llama_path},qwen2={tiny_qwen2_path}"
    return run_two_ranks(_worker, paths, tmp_path_factory.mktemp("fused_lm_head"))


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_worker_fused_equals_unfused(worker_results: list[dict], name: str, packed: bool) -> None:
    for rank, results in enumerate(worker_results):
        fused, full = results[name, 5, packed, SEQ], results[name, None, packed, SEQ]
        torch.testing.assert_close(fused["logprobs"], full["logprobs"], **TOL)
        assert fused["loss"] == pytest.approx(full["loss"], rel=1e-6, abs=1e-6)
        assert fused["grads"].keys() == full["grads"].keys()
        for param, grad in full["grads"].items():
            assert grad.abs().sum() > 0, f"rank {rank}: {param} got no gradient"
            torch.testing.assert_close(fused["grads"][param], grad, **TOL, msg=lambda m: f"rank {rank}: {param}: {m}")


@pytest.mark.slow
def test_worker_trims_padding_to_each_micro_batchs_longest_row(worker_results: list[dict]) -> None:
    """DP=2, micro-batches of 2 rows: rank 0 holds lengths (13, 6), rank 1 (9, 3); a batch
    padded to 19 columns is cut to them and scores, trains and back-propagates as the 13-column
    batch does (logprobs padded back to 19 columns with zeros)."""
    for rank, longest in enumerate((13, 9)):
        wide, narrow = worker_results[rank]["dp2", 5, False, SEQ + 6], worker_results[rank]["dp2", 5, False, SEQ]
        assert wide["widths"] == [longest] and narrow["widths"] == [longest]
        assert wide["logprobs"].shape == (2, SEQ + 6) and not wide["logprobs"][:, SEQ:].any()
        torch.testing.assert_close(wide["logprobs"][:, :SEQ], narrow["logprobs"], rtol=0, atol=0)
        assert wide["loss"] == narrow["loss"]
        for param, grad in narrow["grads"].items():
            torch.testing.assert_close(wide["grads"][param], grad, rtol=0, atol=0)
