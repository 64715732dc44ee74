"""The trained algorithms at TP=2 (with and without sequence parallelism) and PP=2 (two gloo
processes) against TP=1: one step of the reward model (Bradley-Terry) gives the same loss,
metrics, grad norm and rewards; one DPO step and one top-k distillation step (mixed KL against
fixed teacher top-k logprobs) the same loss, metrics and grad norm (1e-5). The sequence length
is odd, so sequence parallelism pads every row to a multiple of TP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from layout_ports import next_layout_port, run_two_ranks
from megatron_bridge.parallel_state import destroy_megatron_parallel

PAIRS, SEQ, VOCAB, TOPK = 4, 13, 1024, 8
ALGORITHMS = ("rm", "dpo", "distillation")
# name: (tp, pp, sequence_parallel); dp2 is a TP=1 model
LAYOUTS = {"dp2": (1, 1, False), "tp2": (2, 1, False), "tp2sp": (2, 1, True), "pp2": (1, 2, False)}


def make_batch() -> Any:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, SEQ + 1, (2 * PAIRS,), generator=gen)
    ids = torch.randint(3, 1000, (2 * PAIRS, SEQ), generator=gen)
    ids[torch.arange(SEQ)[None, :] >= lengths[:, None]] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=torch.ones(2 * PAIRS, SEQ),
        sample_mask=torch.ones(2 * PAIRS),
        # DPO's frozen reference and a teacher's top-k, as data: the same on every layout
        reference_policy_logprobs=-torch.rand(2 * PAIRS, SEQ, generator=gen),
        **dict(zip(("teacher_topk_logits", "teacher_topk_indices"), torch.log_softmax(
            torch.randn(2 * PAIRS, SEQ, VOCAB, generator=gen), dim=-1
        ).topk(TOPK, dim=-1))),
    )


def _worker(rank: int, model_path: str, out_dir: str, port: int) -> dict[Any, Any]:
    from nemo_rl.algorithms.loss import DistillationLossFn, DPOLossFn, PreferenceLossFn
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.workers.megatron.model_setup import setup_policy_model
    from nemo_rl.models.policy.workers.megatron.train_step import compute_rewards, iterate_steps

    results = {}
    for name, (tp, pp, sp) in LAYOUTS.items():
        for algorithm in ALGORITHMS:
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port))
            config = PolicyConfig(
                model_name=model_path,
                train_global_batch_size=PAIRS,
                train_micro_batch_size=1,
                max_total_sequence_length=SEQ,
                precision="float32",
                reward_model_cfg={"enabled": algorithm == "rm"},
                megatron_cfg={
                    "tensor_model_parallel_size": tp,
                    "pipeline_model_parallel_size": pp,
                    "sequence_parallel": sp,
                    "optimizer": {"lr": 1e-2, "min_lr": 1e-2},
                },
            )
            policy = setup_policy_model(config, model_path, seed=3)
            dp = policy.layout.dp
            batch = make_batch()
            shard = batch.get_batch(rank, batch.size // dp) if dp > 1 else batch
            if algorithm == "rm":
                rewards = compute_rewards(policy, shard, 2, False)
                loss_fn: Any = PreferenceLossFn()
            elif algorithm == "dpo":
                rewards, loss_fn = None, DPOLossFn({"reference_policy_kl_penalty": 0.1})
            else:
                rewards = None
                loss_fn = DistillationLossFn({"kl_type": "mixed", "zero_outside_topk": True})
            (step,) = iterate_steps(policy, shard, loss_fn, 2 * PAIRS, 2, False, False)
            results[name, algorithm] = {"step": step, "rewards": rewards}
            port = next_layout_port()
            destroy_megatron_parallel()
    return results


@pytest.fixture(scope="module")
def results(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_two_ranks(_worker, tiny_llama_path, tmp_path_factory.mktemp("rm_parallel"))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name", ["tp2", "tp2sp", "pp2"])
def test_one_step_matches_tp1(results: list[dict], name: str, algorithm: str) -> None:
    reference = results[0]["dp2", algorithm]["step"]  # both DP ranks hold the global sums
    last = results[1][name, algorithm]  # rank 1 is a last pipeline stage in every layout
    for key in ("loss", "grad_norm"):
        assert last["step"][key] == pytest.approx(reference[key], abs=1e-5), key
    assert reference["metrics"]  # DPO: accuracy, ...; distillation: forward_kl, reverse_kl
    for key, value in reference["metrics"].items():
        assert last["step"]["metrics"][key] == pytest.approx(value, abs=1e-5), key
    if algorithm == "rm":
        tp1 = torch.cat([results[0]["dp2", "rm"]["rewards"], results[1]["dp2", "rm"]["rewards"]])
        torch.testing.assert_close(last["rewards"], tp1, rtol=0, atol=1e-5)
