"""Restarting the policy's optimizer (what GRPO does after an SFT warm start), in one process.

A policy trained for two steps and then restarted must take exactly the steps a brand-new
optimizer takes from the same weights: Adam moments and step counts zeroed (bias correction
starts over) and the new learning-rate schedule followed from its step 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from megatron_bridge.parallel_state import destroy_megatron_parallel, find_free_port
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.workers.megatron.model_setup import (
    PolicyModel,
    build_gpt_stage,
    build_optimizer,
    build_scheduler,
    restart_optimizer,
    setup_policy_model,
    wrap_ddp,
)
from nemo_rl.models.policy.workers.megatron.train_step import iterate_steps

GBS, MBS, SEQ = 4, 2, 16
RESTART = {"lr": 5e-4, "min_lr": 1e-4}
RESTART_SCHEDULE = {"lr_decay_style": "linear", "lr_warmup_iters": 0, "lr_decay_iters": 2}


def make_batch(seed: int) -> BatchedDataDict:
    """``GBS`` full-length random rows ``[GBS, SEQ]`` with NLL loss keys."""
    gen = torch.Generator().manual_seed(seed)
    return BatchedDataDict(
        input_ids=torch.randint(1, 1000, (GBS, SEQ), generator=gen),
        input_lengths=torch.full((GBS,), SEQ),
        token_mask=torch.ones(GBS, SEQ),
        sample_mask=torch.ones(GBS),
    )


def train(policy: PolicyModel, seed: int) -> dict[str, Any]:
    (step,) = iterate_steps(policy, make_batch(seed), NLLLoss(), GBS, MBS, False, False)
    return step


def weights(policy: PolicyModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.model.module.parameters()]


@pytest.fixture
def config(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PolicyConfig]:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    yield PolicyConfig(
        model_name=str(tiny_llama_path),
        train_global_batch_size=GBS,
        train_micro_batch_size=MBS,
        max_total_sequence_length=SEQ,
        precision="float32",
        megatron_cfg={
            "optimizer": {"lr": 1e-3, "min_lr": 1e-3, "use_distributed_optimizer": False}
        },
    )
    destroy_megatron_parallel()


def test_restart_steps_like_a_new_optimizer_from_the_same_weights(
    config: PolicyConfig, tiny_llama_path: Path
) -> None:
    trained = setup_policy_model(config, str(tiny_llama_path), seed=1)
    for seed in (0, 1):
        train(trained, seed)
    opt_cfg, sched_cfg = config.megatron_cfg.lr_schedule({**RESTART, **RESTART_SCHEDULE})
    restart_optimizer(trained, opt_cfg, sched_cfg)

    # A second model stage with its own optimizer, built for the restart schedule, then given
    # the trained weights.
    model, _, tconfig = build_gpt_stage(
        str(tiny_llama_path), config, trained.layout, torch.float32
    )
    ddp = wrap_ddp(model, tconfig, use_distributed_optimizer=False)
    optimizer = build_optimizer(ddp, opt_cfg, torch.float32)
    fresh = PolicyModel(
        ddp,
        optimizer,
        build_scheduler(optimizer, opt_cfg, sched_cfg),
        trained.bridge,
        trained.layout,
        torch.float32,
    )
    with torch.no_grad():
        for target, source in zip(fresh.model.module.parameters(), weights(trained)):
            target.copy_(source)

    lrs = []
    for seed in (2, 3):
        got, expected = train(trained, seed), train(fresh, seed)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
        lrs.append((got["lr"], expected["lr"]))
    # linear decay from lr at step 0 to min_lr at lr_decay_iters=2
    assert lrs == [(pytest.approx(5e-4), pytest.approx(5e-4)), (pytest.approx(3e-4), pytest.approx(3e-4))]
    for a, b in zip(weights(trained), weights(fresh)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
