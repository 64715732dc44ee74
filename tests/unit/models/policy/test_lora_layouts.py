"""A LoRA policy (``megatron_cfg.peft``) at TP=2 (with and without sequence parallelism), PP=2
and CP=2 (two gloo processes) against TP=1, through the real set-up and training step
(``setup_policy_model`` + ``iterate_steps``: DDP, gradient finalisation, optimizer):

* with ``B = 0`` (as initialised) the logprobs are the base model's, bit for bit, and so are
  they with the adapters switched off (the reference policy) after ``B`` has changed;
* from the same non-zero adapters, one NLL step gives the same loss and the same adapter
  gradients (1e-5; SGD with lr 1 and no momentum history, so the update is the gradient);
* the base weights do not move, and only the adapters have gradient buffers and optimizer
  state;
* the merged export (``W + scale * B A``) is the same at every layout (1e-6);
* the TP=2 policy's checkpoint loads at TP=1 x DP=2 with the same adapters, bit for bit, and
  its export without a model (``nemo-rl export``'s stream) is the trained policy's merged export
  and its PEFT-layout adapters (``megatron-bridge convert --to peft``'s stream) the trained
  policy's adapters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from layout_ports import next_layout_port, run_two_ranks
from megatron_bridge.parallel_state import destroy_megatron_parallel

ROWS, SEQ, DIM = 4, 11, 4
# name: (tp, pp, sequence_parallel, cp); dp2 is a TP=1 model on each rank
LAYOUTS = {
    "dp2": (1, 1, False, 1), "tp2": (2, 1, False, 1), "tp2sp": (2, 1, True, 1),
    "pp2": (1, 2, False, 1), "cp2": (1, 1, False, 2),
}
SAVED = "tp2"  # its trained state is saved, then loaded at TP=1 (dp2)


def make_batch() -> Any:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, SEQ + 1, (ROWS,), generator=gen)
    ids = torch.randint(3, 1000, (ROWS, SEQ), generator=gen)
    t = torch.arange(SEQ)[None, :]
    ids[t >= lengths[:, None]] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=((t >= 1) & (t < lengths[:, None])).float(),
        sample_mask=torch.ones(ROWS),
    )


def random_adapters(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors of ``like``'s names and shapes, drawn from a fixed seed; the A of
    projections fused into one linear (q/k/v, gate/up) are equal, as one adapter holds them."""
    from megatron_bridge.lora_targets import HF_NAMES

    gen = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    shared_a: dict[str, torch.Tensor] = {}
    for name in sorted(like):
        tensor = torch.randn(like[name].shape, generator=gen) * 0.1
        if name.endswith("lora_A.weight"):  # e.g. model.layers.0.self_attn.q_proj.lora_A.weight
            projection = name.split(".")[-3]
            linear = name.replace(f".{projection}.", f".{HF_NAMES[projection]}.")
            tensor = shared_a.setdefault(linear, tensor)
        out[name] = tensor
    return out


def _config(model_path: str, tp: int, pp: int, sp: bool, cp: int) -> Any:
    from nemo_rl.models.policy.config import PolicyConfig

    return PolicyConfig(
        model_name=model_path,
        train_global_batch_size=ROWS,
        train_micro_batch_size=1,
        logprob_batch_size=2,
        max_total_sequence_length=SEQ,
        megatron_cfg={
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "sequence_parallel": sp,
            "context_parallel_size": cp,
            "peft": {"enabled": True, "dim": DIM, "alpha": 8},
            "optimizer": {
                "optimizer": "sgd", "lr": 1.0, "min_lr": 1.0, "weight_decay": 0.0,
                "clip_grad": 0.0,
            },
        },
    )


def _step(rank: int, model_path: str, name: str, port: int, out_dir: str) -> dict[str, Any]:
    from megatron_bridge import export_hf_weights
    from megatron_bridge.lora import adapters_disabled
    from megatron_bridge.lora_targets import is_adapter_param
    from megatron_bridge.lora_weights import export_lora_weights, load_lora_weights
    from nemo_rl.algorithms.loss import NLLLoss
    from nemo_rl.models.megatron.optimizer_parts import optimizer_parts
    from nemo_rl.models.policy.workers.megatron.checkpointing import save_training_checkpoint
    from nemo_rl.models.policy.workers.megatron.model_setup import setup_policy_model
    from nemo_rl.models.policy.workers.megatron.train_step import compute_logprobs, iterate_steps

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port))
    policy = setup_policy_model(_config(model_path, *LAYOUTS[name]), model_path, seed=3)
    module = policy.model.module
    dp = policy.layout.dp
    batch = make_batch()
    shard = batch.get_batch(rank, ROWS // dp) if dp > 1 else batch
    result: dict[str, Any] = {}
    result["base_logprobs"] = compute_logprobs(policy, shard, 2, False)
    with adapters_disabled(module):
        result["off_logprobs_at_init"] = compute_logprobs(policy, shard, 2, False)
    adapters = random_adapters(dict(export_lora_weights(module, policy.bridge)))
    load_lora_weights(module, policy.bridge, adapters)
    with adapters_disabled(module):
        result["off_logprobs"] = compute_logprobs(policy, shard, 2, False)
    result["merged"] = {k: v.clone() for k, v in export_hf_weights(module, policy.bridge)}
    base_before = {n: p.detach().clone() for n, p in module.named_parameters() if not is_adapter_param(n)}
    (step,) = iterate_steps(policy, shard, NLLLoss(), ROWS, 1, False, False)
    after = dict(export_lora_weights(module, policy.bridge))
    if name == SAVED:
        save_training_checkpoint(policy, Path(out_dir) / name, step=1)
        result["merged_after"] = {k: v.clone() for k, v in export_hf_weights(module, policy.bridge)}
    result["after"] = after
    result["step"] = step
    result["grads"] = {k: adapters[k] - after[k] for k in adapters}
    result["base_moved"] = [
        n for n, p in module.named_parameters() if n in base_before and not torch.equal(p, base_before[n])
    ]
    result["trainable"] = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    result["adapter_numel"] = sum(p.numel() for n, p in module.named_parameters() if is_adapter_param(n))
    result["grad_buffer_numel"] = sum(b.grad_data.numel() for b in policy.model.buffers)
    result["optimizer_params"] = sum(
        p.numel()
        for part in optimizer_parts(policy.optimizer)
        for group in part.optimizer.param_groups
        for p in group["params"]
    )
    return result


def _load_saved(rank: int, model_path: str, port: int, out_dir: str) -> dict[str, torch.Tensor]:
    """The adapters of the :data:`SAVED` layout's checkpoint, loaded at TP=1 x DP=2."""
    from megatron_bridge.lora_weights import export_lora_weights
    from nemo_rl.models.policy.workers.megatron.checkpointing import load_training_checkpoint
    from nemo_rl.models.policy.workers.megatron.model_setup import setup_policy_model

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port))
    policy = setup_policy_model(_config(model_path, 1, 1, False, 1), model_path, seed=4)
    assert load_training_checkpoint(policy, Path(out_dir) / SAVED) == 1
    return dict(export_lora_weights(policy.model.module, policy.bridge))


def _worker(rank: int, model_path: str, out_dir: str, port: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in LAYOUTS:
        results[name] = _step(rank, model_path, name, port, out_dir)
        port = next_layout_port()
        destroy_megatron_parallel()
    results["loaded"] = _load_saved(rank, model_path, port, out_dir)
    results["saved_dir"] = str(Path(out_dir) / SAVED)
    destroy_megatron_parallel()
    return results


@pytest.fixture(scope="module")
def results(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_two_ranks(_worker, tiny_llama_path, tmp_path_factory.mktemp("lora_layouts"))


def _last_stage(results: list[dict], name: str) -> dict:
    return results[1][name]  # rank 1 is a last pipeline stage in every layout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_b_is_the_base_model_and_adapters_off_is_the_base_after_training(
    results: list[dict], name: str
) -> None:
    mine = _last_stage(results, name)
    assert torch.equal(mine["base_logprobs"], mine["off_logprobs_at_init"])
    assert torch.equal(mine["off_logprobs"], mine["base_logprobs"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "tp2sp", "pp2", "cp2"])
def test_one_step_matches_tp1(results: list[dict], name: str) -> None:
    reference = results[0]["dp2"]  # both DP ranks hold the global sums
    mine = _last_stage(results, name)
    assert mine["step"]["loss"] == pytest.approx(reference["step"]["loss"], abs=1e-5)
    assert mine["step"]["grad_norm"] == pytest.approx(reference["step"]["grad_norm"], abs=1e-5)
    assert sorted(mine["grads"]) == sorted(reference["grads"])
    for key, grad in reference["grads"].items():
        torch.testing.assert_close(mine["grads"][key], grad, rtol=0, atol=1e-5, msg=key)
    # Every adapter gets a gradient: A's through a non-zero B, B's through A x.
    assert all(g.abs().max() > 0 for g in reference["grads"].values())
    for key, tensor in reference["merged"].items():
        torch.testing.assert_close(mine["merged"][key], tensor, rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_only_adapters_train(results: list[dict], name: str) -> None:
    for rank in (0, 1):
        mine = results[rank][name]
        assert mine["base_moved"] == []
        assert mine["trainable"] and all(n.endswith(("lora_A", "lora_B")) for n in mine["trainable"])
        assert mine["grad_buffer_numel"] == mine["adapter_numel"]
        assert mine["optimizer_params"] == mine["adapter_numel"]


@pytest.mark.slow
def test_a_tp2_checkpoint_loads_at_tp1(results: list[dict]) -> None:
    saved = results[0][SAVED]["after"]
    for rank in (0, 1):
        loaded = results[rank]["loaded"]
        assert sorted(loaded) == sorted(saved)
        for key, tensor in saved.items():
            assert torch.equal(loaded[key], tensor), key


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["merged", "adapters"])
def test_a_tp2_checkpoint_exports_the_trained_policy(results: list[dict], stream: str) -> None:
    """Without a model: the merged HF weights (``nemo-rl export --merged``) and the PEFT-layout
    adapters (``nemo-rl export``) of the trained TP=2 policy."""
    from megatron_bridge import checkpoint_hf_weights
    from megatron_bridge.checkpoint import checkpoint_bridge
    from megatron_bridge.dist_ckpt_reader import checkpoint_lora_weights

    ckpt = results[0]["saved_dir"]
    read = checkpoint_hf_weights if stream == "merged" else checkpoint_lora_weights
    exported = dict(read(ckpt, checkpoint_bridge(ckpt)))
    live = results[0][SAVED]["merged_after" if stream == "merged" else "after"]
    assert sorted(exported) == sorted(live)
    for key, tensor in live.items():
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=1e-6, msg=key)
    before = results[0][SAVED]["merged"]
    if stream == "merged":
        assert any(not torch.equal(live[k], before[k]) for k in live)  # trained
