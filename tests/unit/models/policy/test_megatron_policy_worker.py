"""MegatronPolicyWorker and the driver-side Policy through real Ray on the tiny Llama (~2 minutes).

Each layout (TP=1, TP=2, PP=2, CP=2, DP=2; two processes at most) gets one worker group that
runs the same script: logprobs of one batch (padded, dynamic and packed micro-batches), eval
losses at several micro-batch splits, one training step, then logprobs again. The TP=1 group
also saves a checkpoint and takes a second step; a fresh TP=1 group and the TP=2 group (after
one more step on another batch) load the checkpoint and must reproduce that second step; the
TP=2 group then loads its own save: every rank gets its saved RNG state. The TP=2 and PP=2
groups save their trained state too:
``nemo-rl export`` of each save must give an HF folder whose transformers logprobs are the
policy's. Assertions compare against transformers' logprobs of the
same checkpoint and across layouts. Finally a ``Policy`` (DP=2, dynamic batching) runs the same
batch through the facade: its sharding, reordering and metric aggregation must reproduce the
worker groups' figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.distributed.batched_data_dict import BatchedDataDict, ShardedBatch
from nemo_rl.distributed.ray_bootstrap import ray_cluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_groups import RayWorkerGroup
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

SEQ = 32
LENGTHS = (32, 5, 17, 9, 24, 12, 30, 7)
GBS = len(LENGTHS)
LAYOUTS: dict[str, dict[str, int]] = {
    "tp1": {"pp": 1, "dp": 1, "cp": 1, "tp": 1},
    "tp2": {"pp": 1, "dp": 1, "cp": 1, "tp": 2},
    "pp2": {"pp": 2, "dp": 1, "cp": 1, "tp": 1},
    "cp2": {"pp": 1, "dp": 1, "cp": 2, "tp": 1},
    "dp2": {"pp": 1, "dp": 2, "cp": 1, "tp": 1},
}
# The training step each layout takes: how its global batch is cut into micro-batches.
TRAIN_MODE = {"tp1": 1, "tp2": 2, "pp2": 4, "cp2": "packed", "dp2": "dynamic"}
TOL = 1e-5
# Layouts whose trained state is saved (tp1's save is also the one resumed from) and exported.
EXPORTED = ("tp1", "tp2", "pp2")


# ------------------------------------------------------------------------------ batch builders


def make_batch(seed: int = 0) -> BatchedDataDict:
    """8 right-padded samples of the LENGTHS, ``[8, 32]``, with NLL loss keys; sample 3 masked."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    positions = torch.arange(SEQ)[None, :]
    ids = torch.randint(1, 1000, (GBS, SEQ), generator=gen)
    ids[positions >= lengths[:, None]] = 0
    token_mask = ((positions >= 1) & (positions < lengths[:, None])).float()
    sample_mask = torch.ones(GBS)
    sample_mask[3] = 0
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=sample_mask
    )


def shard(batch: BatchedDataDict, dp: int, mode: Any) -> ShardedBatch:
    """DP shards of ``batch`` for ``mode`` (an int: fixed micro-batches; "dynamic"; "packed")."""
    common = {"input_key": "input_ids", "input_lengths_key": "input_lengths"}
    if mode == "dynamic":
        args = {**common, "max_tokens_per_microbatch": 64, "sequence_length_round": 8}
        return batch.shard_by_batch_size(dp, batch_size=GBS, dynamic_batching_args=args)
    if mode == "packed":
        args = {
            **common,
            "max_tokens_per_microbatch": 64,
            "sequence_length_round": 4,
            "algorithm": "modified_first_fit_decreasing",
        }
        return batch.shard_by_batch_size(dp, batch_size=GBS, sequence_packing_args=args)
    return batch.shard_by_batch_size(dp, batch_size=GBS)


def policy_config(model_path: Path, layout: dict[str, int]) -> PolicyConfig:
    return PolicyConfig(
        model_name=str(model_path),
        train_global_batch_size=GBS,
        train_micro_batch_size=2,
        logprob_batch_size=2,
        max_total_sequence_length=SEQ,
        megatron_cfg={
            "tensor_model_parallel_size": layout["tp"],
            "pipeline_model_parallel_size": layout["pp"],
            "context_parallel_size": layout["cp"],
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4},
        },
        sequence_packing={"enabled": True},
    )


# ------------------------------------------------------------------------------ driving groups


def call(group: RayWorkerGroup, method: str, batch: BatchedDataDict, mode: Any = 2, **kwargs: Any) -> Any:
    """``method`` on every rank with its DP shard; logprob outputs come back as one [B, S]
    tensor in ``batch``'s row order, train outputs as DP rank 0's dict."""
    sharded = shard(batch, group.dp_size, mode)
    shards, order = sharded.shards, sharded.sorted_indices
    data = shards if "dp" in group.sharding.names else shards[0]
    results = group.get_all_worker_results(
        group.run_all_workers_sharded_data(method, data, common_kwargs=kwargs), timeout_s=300
    )
    if method == "train":
        return results[0]
    key = next(iter(results[0]))
    merged = BatchedDataDict(**{key: torch.cat([r[key] for r in results])})
    return merged.reorder_data(order)[key]


def run_layout(group: RayWorkerGroup, name: str, ckpt_dir: Path) -> dict[str, Any]:
    """The script every layout runs; returns what the tests compare."""
    batch, loss = make_batch(), NLLLoss()
    out: dict[str, Any] = {
        "logprobs": {m: call(group, "get_logprobs", batch, m) for m in (2, "dynamic", "packed")},
        "eval_loss": {
            m: call(group, "train", batch, m, loss_fn=loss, eval_mode=True, gbs=GBS, mbs=m if isinstance(m, int) else None)["loss"][0]
            for m in (1, 2, 4, "dynamic", "packed")
        },
    }
    mode = TRAIN_MODE[name]
    mbs = mode if isinstance(mode, int) else None
    out["step1"] = call(group, "train", batch, mode, loss_fn=loss, gbs=GBS, mbs=mbs)
    out["logprobs_after"] = call(group, "get_logprobs", batch)
    out["reference_after"] = call(group, "get_reference_policy_logprobs", batch)
    if name in EXPORTED:
        ray_get_all(group, "save_checkpoint", str(saved_checkpoint(ckpt_dir, name)))
    if name == "tp1":
        out["step2"] = call(group, "train", make_batch(seed=1), 2, loss_fn=loss, gbs=GBS)
    return out


def saved_checkpoint(ckpt_dir: Path, name: str) -> Path:
    """Where layout ``name`` saves its state after the first step."""
    return ckpt_dir if name == "tp1" else ckpt_dir.with_name(f"step1_{name}")


def ray_get_all(group: RayWorkerGroup, method: str, *args: Any) -> list[Any]:
    return group.get_all_worker_results(
        group.run_all_workers_single_data(method, *args), timeout_s=300
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayVirtualCluster]:
    with ray_cluster(num_cpus=8):
        cl = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1.0)
        yield cl
        cl.shutdown()


def start_group(cluster: RayVirtualCluster, model_path: Path, layout: dict[str, int]) -> RayWorkerGroup:
    return RayWorkerGroup(
        cluster,
        MegatronPolicyWorker,
        {k: v for k, v in layout.items() if v > 1 or k == "dp"},
        actor_kwargs={"config": policy_config(model_path, layout), "model_path": str(model_path)},
    )


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron_ckpt") / "step1"


@pytest.fixture(scope="module")
def results(cluster, tiny_llama_path, ckpt_dir) -> dict[str, Any]:
    """Each layout's script (run_layout) on its own group, TP=1 first (its save is resumed);
    the TP=2 group then also resumes from the TP=1 save and reloads its own (``resumed``)."""
    out: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        group = start_group(cluster, tiny_llama_path, layout)
        try:
            out[name] = run_layout(group, name, ckpt_dir)
            out[name]["train_step"] = ray_get_all(group, "get_train_step")[0]
            if name == "tp2":
                out[name]["resumed"] = diverge_and_resume(group, ckpt_dir)
        finally:
            group.shutdown("shutdown")
    return out


def resume(group: RayWorkerGroup, ckpt: Path) -> dict[str, Any]:
    """Load the TP=1 save ``ckpt`` into ``group`` and take the second step: the train step
    the group is at after loading (``step``) and the second step's result (``step2``)."""
    ray_get_all(group, "load_checkpoint", str(ckpt))
    return {
        "step": ray_get_all(group, "get_train_step")[0],
        "step2": call(group, "train", make_batch(seed=1), 2, loss_fn=NLLLoss(), gbs=GBS),
    }


def _advance_rng(worker: Any) -> None:
    torch.rand(7)


def _rank_and_rng(worker: Any) -> tuple[int, torch.Tensor]:
    return torch.distributed.get_rank(), torch.get_rng_state()


def diverge_and_resume(group: RayWorkerGroup, ckpt_dir: Path) -> dict[str, Any]:
    """On the TP=2 group after its script (and its save): one more step on another batch, so
    its weights, optimizer and step (2) are no longer those of the TP=1 save, then
    :func:`resume` from that save; then every rank's RNG moved off, the group's own TP=2 save
    loaded (same layout) and each rank's RNG state read (``rng_states``: (rank, state))."""
    import ray

    call(group, "train", make_batch(seed=2), 2, loss_fn=NLLLoss(), gbs=GBS)
    out = resume(group, ckpt_dir)
    ray.get([w.__ray_call__.remote(_advance_rng) for w in group.workers])
    ray_get_all(group, "load_checkpoint", str(saved_checkpoint(ckpt_dir, "tp2")))
    out["rng_states"] = ray.get([w.__ray_call__.remote(_rank_and_rng) for w in group.workers])
    return out


@pytest.fixture(scope="module")
def resumed(results, cluster, tiny_llama_path, ckpt_dir) -> dict[str, Any]:
    """A fresh TP=1 group and the TP=2 group that diverged (``diverge_and_resume``), both
    resumed from the TP=1 save."""
    group = start_group(cluster, tiny_llama_path, LAYOUTS["tp1"])
    try:
        fresh = resume(group, ckpt_dir)
    finally:
        group.shutdown("shutdown")
    return {"tp1": fresh, "tp2": results["tp2"]["resumed"]}


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_path) -> torch.Tensor:
    """transformers' fp32 logprobs of make_batch() in the worker's convention."""
    return transformers_logprobs(tiny_llama_path)


def transformers_logprobs(hf_dir: Path) -> torch.Tensor:
    """transformers' fp32 logprobs of make_batch() on the HF folder ``hf_dir``, ``[B, S]``, in
    the worker's convention (0 at position 0 and past each length)."""
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(GBS, 1), lp], dim=1)
    valid = torch.arange(SEQ)[None, :] < batch["input_lengths"][:, None]
    return torch.where(valid, lp, torch.zeros(()))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(abs(a), abs(b))


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logprobs_match_transformers(results, hf_logprobs, name):
    for mode, lp in results[name]["logprobs"].items():
        assert lp.shape == (GBS, SEQ) and lp.dtype == torch.float32
        diff = (lp - hf_logprobs).abs().max().item()
        assert diff <= TOL, f"{name} {mode}: max |megatron - HF| = {diff}"
        assert (lp[:, 0] == 0).all()
        for i, n in enumerate(LENGTHS):
            assert (lp[i, n:] == 0).all()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eval_loss_is_independent_of_micro_batching(results, name):
    losses = results[name]["eval_loss"]
    reference = results["tp1"]["eval_loss"][1]
    for mode, value in losses.items():
        assert _close(value, reference), f"{name} micro-batches {mode}: {value} vs {reference}"


def test_eval_loss_equals_nll_of_transformers(results, hf_logprobs):
    batch = make_batch()
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    expected = float(-(hf_logprobs * mask).sum() / mask.sum())
    assert _close(results["tp1"]["eval_loss"][1], expected)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "tp1"])
def test_train_step_same_loss_and_grad_norm_across_layouts(results, name):
    ref, got = results["tp1"]["step1"], results[name]["step1"]
    assert _close(got["loss"][0], ref["loss"][0]), (name, got["loss"], ref["loss"])
    assert _close(got["grad_norm"][0], ref["grad_norm"][0]), (name, got["grad_norm"], ref["grad_norm"])
    assert got["lr"] == ref["lr"] == [1e-3]
    assert got["metrics"]["num_valid_samples"] == [7.0]
    assert results[name]["train_step"] == 1


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_changes_policy_not_reference(results, name):
    before = results[name]["logprobs"][2]
    assert (results[name]["logprobs_after"] - before).abs().max() > 1e-3
    assert (results[name]["reference_after"] - before).abs().max() <= TOL


@pytest.mark.parametrize("name", ["tp1", "tp2"])
def test_resume_from_checkpoint_reproduces_next_step(results, resumed, name):
    expected = results["tp1"]["step2"]
    resumed = resumed[name]
    assert resumed["step"] == 1
    assert _close(resumed["step2"]["loss"][0], expected["loss"][0])
    assert _close(resumed["step2"]["grad_norm"][0], expected["grad_norm"][0])


def test_every_rank_restores_its_rng_at_the_same_layout(resumed, ckpt_dir):
    """Loading a TP=2 save at TP=2 gives every rank (not only rank 0) its saved RNG state
    (the TP=2 group's last load, its RNG moved off before: ``diverge_and_resume``)."""
    saved = saved_checkpoint(ckpt_dir, "tp2")
    states = resumed["tp2"]["rng_states"]
    assert sorted(rank for rank, _ in states) == [0, 1]
    for rank, state in states:
        want = torch.load(saved / "rng" / f"rank_{rank}.pt", weights_only=False)["cpu"]
        assert torch.equal(state, want), f"rank {rank}"


@pytest.mark.parametrize("name", EXPORTED)
def test_export_of_a_saved_policy_has_its_logprobs(results, ckpt_dir, tiny_llama_path, tmp_path, name):
    """The export of a checkpoint saved at TP=1, TP=2 or PP=2 is the trained policy in HF form:
    transformers' logprobs equal the policy's after its step, and the tokenizer came along."""
    import json

    from transformers import AutoTokenizer

    from nemo_rl.models.policy.export import export_checkpoint

    saved = saved_checkpoint(ckpt_dir, name)
    layout = json.loads((saved / "layout.json").read_text())
    assert (layout["tp"], layout["pp"], layout["optimizer_step"]) == (
        LAYOUTS[name]["tp"], LAYOUTS[name]["pp"], 1
    )
    export_checkpoint(saved, tmp_path / "hf")
    diff = (transformers_logprobs(tmp_path / "hf") - results[name]["logprobs_after"]).abs().max()
    assert diff <= TOL, f"{name}: exported model vs policy logprobs {diff}"
    source, exported = (AutoTokenizer.from_pretrained(p) for p in (tiny_llama_path, tmp_path / "hf"))
    assert exported.chat_template == source.chat_template
    assert exported("What is 3 + 4?")["input_ids"] == source("What is 3 + 4?")["input_ids"]


def test_export_of_a_checkpoint_saved_without_bridge_json(results, ckpt_dir, tiny_llama_path, tmp_path):
    """A policy folder from before checkpoints carried bridge.json exports with --model: the
    same safetensors as the self-describing folder gives; the checkpoint is left unchanged."""
    import shutil

    from nemo_rl.models.policy.export import export_checkpoint

    old = tmp_path / "old"
    shutil.copytree(ckpt_dir, old, ignore=shutil.ignore_patterns("bridge.json", "hf_assets"))
    before = sorted(p.name for p in old.iterdir())
    export_checkpoint(old, tmp_path / "hf_old", model=str(tiny_llama_path))
    export_checkpoint(ckpt_dir, tmp_path / "hf_new")
    assert sorted(p.name for p in old.iterdir()) == before
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "hf_old" / name).read_bytes() == (tmp_path / "hf_new" / name).read_bytes()


# ------------------------------------------------------------------------------ the Policy facade


@pytest.fixture(scope="module")
def policy_results(results, cluster, tiny_llama_path) -> dict[str, Any]:
    """A DP=2 Policy with dynamic batching (the dp2 group's budget) on make_batch()."""
    config = PolicyConfig.model_validate(
        {
            **policy_config(tiny_llama_path, LAYOUTS["tp1"]).model_dump(),
            "sequence_packing": {"enabled": False},
            "dynamic_batching": {
                "enabled": True,
                "train_mb_tokens": 64,
                "logprob_mb_tokens": 64,
                "sequence_length_round": 8,
            },
        }
    )
    policy = Policy(cluster, config)
    batch = make_batch()
    try:
        out: dict[str, Any] = {"layout": policy.layout.axes()}
        out["logprobs"] = policy.get_logprobs(batch)["logprobs"]
        out["eval"] = policy.train(batch, NLLLoss(), eval_mode=True)
        out["train"] = policy.train(batch, NLLLoss())
        out["reference"] = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
        out["logprobs_after"] = policy.get_logprobs(batch)["logprobs"]
        with pytest.raises(ValueError, match="multiple of"):
            policy.train(batch.slice(0, 6), NLLLoss(), gbs=3)
    finally:
        policy.shutdown()
    return out


def test_policy_logprobs_in_caller_order(policy_results, hf_logprobs, results):
    assert policy_results["layout"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 1}
    diff = (policy_results["logprobs"] - hf_logprobs).abs().max().item()
    assert diff <= TOL, f"Policy logprobs vs HF: {diff}"
    assert (policy_results["reference"] - hf_logprobs).abs().max().item() <= TOL
    after = policy_results["logprobs_after"]
    assert torch.allclose(after, results["dp2"]["logprobs_after"], atol=TOL, rtol=0)


def test_policy_train_aggregates_the_global_step(policy_results, results):
    evaluated, trained, worker = policy_results["eval"], policy_results["train"], results["dp2"]["step1"]
    assert evaluated["grad_norm"] == [None]
    assert _close(evaluated["loss"][0], results["tp1"]["eval_loss"][1])
    assert _close(trained["loss"][0], worker["loss"][0])
    assert _close(trained["grad_norm"][0], worker["grad_norm"][0])
    assert trained["lr"] == [1e-3]
    assert trained["metrics"]["num_valid_samples"] == [7.0]
    # both replicas' micro-batches are counted (the dp2 worker result is one replica's)
    assert trained["num_micro_batches"][0] == 2 * worker["num_micro_batches"][0]
