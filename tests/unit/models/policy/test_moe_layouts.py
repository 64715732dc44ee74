"""The policy rank on the tiny mixture-of-experts model (tiny-qwen3-moe: 4 experts, top-2) at
EP=2, TP=2, PP=2 and CP=2 (two gloo processes) against EP=1: logprobs and the eval loss equal
transformers' / EP=1's; one NLL step with the router's load-balancing loss and z-loss on gives
the same loss, grad norm and router-loss metrics at EP=2, TP=2, PP=2 and CP=2 (TP=2 with
sequence parallelism, megatron-core's rule for training MoE under TP, on the local spec); a
checkpoint saved at EP=2 and loaded at EP=1 takes the same next step as EP=2 itself, and the
streamed export of that checkpoint (no model built) equals the model's own export bitwise; a
frozen router stays as loaded while the experts train. Micro-batches are trimmed to their
longest row, and TP=2 (sequence parallelism) and CP=2 pad the trimmed rows again to their
multiples: the routers leave padding out of their losses, so those steps equal EP=1's and the
same layouts' steps on untrimmed micro-batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from unittest import mock

from layout_ports import next_layout_port, run_two_ranks
from megatron_bridge.parallel_state import destroy_megatron_parallel

pytestmark = pytest.mark.slow

GBS, SEQ = 4, 16
TOL = 1e-5
# name: (tp, pp, ep, freeze_moe_router, router loss coefficients and other megatron_cfg keys);
# dp2 is the EP=1 reference (the same micro-batches, so the same per-micro-batch router
# losses), "resume" loads ep2's checkpoint at EP=1.
COEFFS = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}
NO_ROUTER_LOSS = {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None}
LAYOUTS = {
    "dp2": (1, 1, 1, False, COEFFS),
    "ep2": (1, 1, 2, False, COEFFS),
    "tp2": (2, 1, 1, False, {**COEFFS, "sequence_parallel": True}),
    "pp2": (1, 2, 1, False, COEFFS),
    "cp2": (1, 1, 1, False, {**COEFFS, "context_parallel_size": 2}),
    "tp2_untrimmed": (2, 1, 1, False, {**COEFFS, "sequence_parallel": True}),
    "cp2_untrimmed": (1, 1, 1, False, {**COEFFS, "context_parallel_size": 2}),
    "resume": (1, 1, 1, False, COEFFS),
    "frozen": (1, 1, 2, True, COEFFS),
    "no_router_loss": (1, 1, 2, False, NO_ROUTER_LOSS),
}
ROUTER_METRICS = ("moe/load_balancing_loss", "moe/z_loss")
# The z-loss metric is megatron's: the ranks' means over their own real tokens, averaged over
# the ranks, which differs from the EP=1 mean where TP/CP shares hold unequal real tokens.
PADDED_SHARES = ("tp2", "cp2")


def make_batch(seed: int = 0) -> Any:
    """4 right-padded samples ``[4, 16]`` with NLL loss keys."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([16, 7, 12, 10])
    positions = torch.arange(SEQ)[None, :]
    ids = torch.randint(3, 1000, (GBS, SEQ), generator=gen)
    ids[positions >= lengths[:, None]] = 0
    token_mask = ((positions >= 1) & (positions < lengths[:, None])).float()
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(GBS)
    )


def _router_weights(policy: Any) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone()
        for name, p in policy.model.module.named_parameters()
        if "router" in name
    }


CKPT_NAME = "ep2_step1"


def _worker(rank: int, model_path: str, out_dir: str, port: int) -> dict[str, Any]:
    from megatron_bridge.export import export_hf_weights
    from nemo_rl.algorithms.loss import NLLLoss
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.workers.megatron.checkpointing import (
        load_training_checkpoint,
        save_training_checkpoint,
    )
    from nemo_rl.models.policy.workers.megatron.model_setup import setup_policy_model
    from nemo_rl.models.policy.workers.megatron import train_step
    from nemo_rl.models.policy.workers.megatron.train_step import compute_logprobs, iterate_steps

    ckpt = Path(out_dir) / CKPT_NAME
    results: dict[str, Any] = {}
    for name, (tp, pp, ep, frozen, extra) in LAYOUTS.items():
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port))
        config = PolicyConfig(
            model_name=model_path,
            train_global_batch_size=GBS,
            train_micro_batch_size=1,
            logprob_batch_size=2,
            max_total_sequence_length=SEQ,
            megatron_cfg={
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep,
                **extra,
                "freeze_moe_router": frozen,
                "optimizer": {"lr": 1e-2, "min_lr": 1e-2},
            },
        )
        policy = setup_policy_model(config, model_path, seed=3)
        dp = policy.layout.dp

        def step(seed: int, eval_mode: bool = False) -> dict[str, Any]:
            batch = make_batch(seed)
            shard = batch.get_batch(rank, GBS // dp) if dp > 1 else batch
            (out,) = iterate_steps(policy, shard, NLLLoss(), GBS, 1, False, eval_mode)
            return out

        out: dict[str, Any] = {}
        if name.endswith("_untrimmed"):  # micro-batches keep the batch's length
            with mock.patch.object(train_step, "trim_to_longest_row", lambda mb: mb):
                out["step1"] = step(0)
            results[name] = out
            port = next_layout_port()
            destroy_megatron_parallel()
            continue
        if name == "resume":
            load_training_checkpoint(policy, ckpt)
        elif name in ("dp2", "ep2", "tp2", "pp2", "cp2"):
            lp = compute_logprobs(policy, make_batch(), 2, False)
            out["logprobs"] = lp
            out["eval_loss"] = step(0, eval_mode=True)["loss"]
        if name != "resume":
            before = _router_weights(policy)
            out["step1"] = step(0)
            out["router_after"] = _router_weights(policy)
            out["router_unchanged"] = all(
                torch.equal(before[k], v) for k, v in out["router_after"].items()
            )
        if name == "ep2":
            save_training_checkpoint(policy, ckpt, step=1)
            # the model's own export of the saved weights (gathered over EP, on every rank)
            out["export"] = {n: t.clone() for n, t in export_hf_weights(policy.model.module,
                                                                        policy.bridge)}
        if name in ("ep2", "resume"):
            out["step2"] = step(1)
        results[name] = out
        port = next_layout_port()
        destroy_megatron_parallel()
    return results


@pytest.fixture(scope="module")
def moe_path() -> Path:
    from nemo_rl.models.model_path import resolve_model_path

    return Path(resolve_model_path("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def run_dir(moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The spawn's folder: ``rank<r>.pt`` results and the EP=2 checkpoint ``CKPT_NAME``."""
    out = tmp_path_factory.mktemp("moe_layouts")
    run_two_ranks(_worker, moe_path, out)
    return out


@pytest.fixture(scope="module")
def results(run_dir: Path) -> list[dict]:
    return [torch.load(run_dir / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def hf_logprobs(moe_path: Path) -> torch.Tensor:
    """transformers' fp32 logprobs of make_batch() in the worker's convention ``[B, S]``
    (0 at position 0 and past each length)."""
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(GBS, 1), lp], dim=1)
    valid = torch.arange(SEQ)[None, :] < batch["input_lengths"][:, None]
    return torch.where(valid, lp, torch.zeros(()))


def _last_stage(results: list[dict], name: str) -> dict:
    return results[1][name]  # rank 1 is a last pipeline stage in every layout


def _rel_close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(abs(a), abs(b))


@pytest.mark.parametrize("name", ["dp2", "ep2", "tp2", "pp2", "cp2"])
def test_logprobs_equal_transformers(results: list[dict], hf_logprobs: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(_last_stage(results, name)["logprobs"], hf_logprobs, rtol=0, atol=TOL)


@pytest.mark.parametrize("name", ["ep2", "tp2", "pp2", "cp2"])
def test_eval_loss_matches_ep1(results: list[dict], name: str) -> None:
    reference = _last_stage(results, "dp2")["eval_loss"]
    assert _rel_close(_last_stage(results, name)["eval_loss"], reference)


@pytest.mark.parametrize("name", ["ep2", "tp2", "pp2", "cp2"])
def test_one_step_matches_ep1(results: list[dict], name: str) -> None:
    reference = _last_stage(results, "dp2")["step1"]
    step = _last_stage(results, name)["step1"]
    for key in ("loss", "grad_norm"):
        assert _rel_close(step[key], reference[key]), (key, step[key], reference[key])
    for key in ROUTER_METRICS:
        assert reference["metrics"][key] > 0
        if key == "moe/z_loss" and name in PADDED_SHARES:
            continue
        assert _rel_close(step["metrics"][key], reference["metrics"][key]), key


@pytest.mark.parametrize("name", ["tp2", "cp2"])
def test_trimmed_step_equals_untrimmed(results: list[dict], name: str) -> None:
    """Trimmed and untrimmed micro-batches hold the same real tokens, padded differently (the
    trimmed rows to TP's or 2 * CP's multiple): the same loss, grad norm and load-balancing
    loss (before the routers' padding mask, 1930 vs 19.9 at TP=2)."""
    trimmed = _last_stage(results, name)["step1"]
    untrimmed = _last_stage(results, f"{name}_untrimmed")["step1"]
    for key in ("loss", "grad_norm"):
        assert _rel_close(trimmed[key], untrimmed[key]), (key, trimmed[key], untrimmed[key])
    key = "moe/load_balancing_loss"
    assert _rel_close(trimmed["metrics"][key], untrimmed["metrics"][key]), key


def test_router_losses_reach_the_update(results: list[dict]) -> None:
    """The same step without the router losses: same NLL loss, no router-loss metrics, other
    router weights after the update."""
    with_losses, without = _last_stage(results, "ep2"), _last_stage(results, "no_router_loss")
    assert without["step1"]["loss"] == with_losses["step1"]["loss"]
    assert not set(ROUTER_METRICS) & set(without["step1"]["metrics"])
    for key, weight in with_losses["router_after"].items():
        assert (weight - without["router_after"][key]).abs().max() > 1e-6, key


def test_frozen_router_keeps_its_weights(results: list[dict]) -> None:
    assert all(r["frozen"]["router_unchanged"] for r in results)
    assert not any(r["ep2"]["router_unchanged"] for r in results)


def test_streamed_export_of_the_ep2_checkpoint_equals_the_models_own(
    run_dir: Path, results: list[dict]
) -> None:
    from megatron_bridge.checkpoint import checkpoint_bridge
    from megatron_bridge.dist_ckpt_reader import checkpoint_hf_weights

    ckpt = run_dir / CKPT_NAME
    streamed = dict(checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt)))
    own = results[0]["ep2"]["export"]
    assert list(streamed) == list(own)
    assert any(".experts." in name for name in own)
    for name, tensor in own.items():
        assert torch.equal(streamed[name], tensor), name


def test_ep2_checkpoint_resumes_at_ep1(results: list[dict]) -> None:
    saved, resumed = _last_stage(results, "ep2")["step2"], _last_stage(results, "resume")["step2"]
    for key in ("loss", "grad_norm"):
        assert _rel_close(resumed[key], saved[key]), (key, resumed[key], saved[key])
    for key in ROUTER_METRICS:
        assert _rel_close(resumed["metrics"][key], saved["metrics"][key]), key
