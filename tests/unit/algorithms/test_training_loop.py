"""The shared training loop on a fake policy: validation cadence, save period, the stop rule and
exact resume (loader position, driver RNG and policy state continue where the saved run was),
the stop rule without checkpointing, and a worker fault's line naming the newest checkpoint."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from nemo_rl.algorithms import training_loop
from nemo_rl.algorithms.sft_config import SFTMasterConfig
from nemo_rl.algorithms.training_loop import LoopParts
from nemo_rl.data.dataloader import StatefulPromptLoader
from nemo_rl.distributed.worker_faults import WorkerDied
from nemo_rl.utils.checkpoint import CheckpointingConfig, CheckpointManager
from nemo_rl.utils.errors import ResumableFault, RunFault
from nemo_rl.utils.logger import LoggerConfig
from nemo_rl.utils.run_stop import RunStopped
from nemo_rl.utils.timer import Timer


class FakePolicy:
    """One float of state; a checkpoint is a file holding it."""

    def __init__(self) -> None:
        self.weight = 0.0

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        torch.save(self.weight, Path(path) / "weight.pt")

    def load_checkpoint(self, path: str) -> None:
        self.weight = torch.load(Path(path) / "weight.pt")


class FakeLogger:
    def __init__(self) -> None:
        self.records: list[tuple[str, int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        self.records.append((prefix, step, dict(metrics)))

    @contextmanager
    def step_progress(self, step: int, max_steps: int, timer: Timer) -> Iterator[None]:
        yield


def make_parts(
    tmp: Path, steps: int, save_period: int = 2, checkpointing: bool = True
) -> LoopParts:
    ckpt = CheckpointingConfig(
        enabled=checkpointing, checkpoint_dir=str(tmp / "ckpt"), save_period=save_period,
        keep_top_k=None,
    )
    cfg = SFTMasterConfig(checkpointing=ckpt, logger=LoggerConfig(log_dir=str(tmp / "logs")))
    loader = StatefulPromptLoader(list(range(10)), 3, seed=1, collate_fn=lambda rows: rows)
    return LoopParts(
        cfg=cfg, policy=FakePolicy(), train_loader=loader, logger=FakeLogger(), timer=Timer(),
        checkpointer=CheckpointManager(ckpt) if checkpointing else None, max_num_steps=steps,
        val_period=3, val_at_start=True,
    )


def run(
    parts: LoopParts, stop_after: int | None = None, fail_at_step: int | None = None
) -> dict[str, float]:
    """Train with a step that mixes the batch and a driver random draw into the weight; a
    stop signal during the step after ``stop_after`` log records; a dead worker in step
    ``fail_at_step``."""

    def step_fn(batches: Iterator[list[int]]) -> dict[str, float]:
        parts.policy.weight = parts.policy.weight * 0.5 + sum(next(batches)) + float(torch.rand(()))
        if stop_after is not None and len(parts.logger.records) >= stop_after:
            os.kill(os.getpid(), signal.SIGUSR1)  # a stop signal during this step
        if fail_at_step is not None and parts.logger.records[-1][1] + 1 == fail_at_step:
            raise WorkerDied("policy worker rank 1 on node2 (10.0.0.2) died during train "
                             "(its node has died)")
        return {"weight": parts.policy.weight}

    with training_loop.stop_guard(parts) as guard:
        step, _ = training_loop.restore_checkpoint(parts)
        return training_loop.train_loop(
            parts, guard, step, step_fn, lambda: {"weight": parts.policy.weight}
        )


def test_validation_and_saves_follow_their_periods(tmp_path: Path) -> None:
    torch.manual_seed(0)
    parts = make_parts(tmp_path, steps=7)
    final = run(parts)
    logged = parts.logger.records
    assert [s for p, s, _ in logged if p == "validation"] == [0, 3, 6]
    assert [s for p, s, _ in logged if p == "train"] == list(range(1, 8))
    saved = sorted(int(p.name.removeprefix("step_")) for p in parts.checkpointer.checkpoints())
    assert saved == [2, 4, 6, 7]  # every save_period and the last step
    assert final["weight"] == parts.policy.weight and final["val_weight"] == logged[-3][2]["weight"]


def test_resumed_run_continues_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    whole = make_parts(tmp_path / "whole", steps=7)
    run(whole)
    expected = [m["weight"] for p, _, m in whole.logger.records if p == "train"]

    torch.manual_seed(0)
    first = make_parts(tmp_path / "split", steps=7)
    with pytest.raises(RunStopped) as stop:
        run(first, stop_after=5)  # a stop request during step 3: that step is saved, then exit
    assert stop.value.step == 3 and stop.value.code == 75
    torch.manual_seed(123)  # the resumed process starts from other RNG state
    second = make_parts(tmp_path / "split", steps=7)
    run(second)
    resumed = [(s, m["weight"]) for p, s, m in second.logger.records if p == "train"]
    assert [s for s, _ in resumed] == [4, 5, 6, 7]
    assert [w for _, w in resumed] == expected[3:]


def test_other_models_are_saved_beside_the_policy_and_restored(tmp_path: Path) -> None:
    """A second trained model (PPO's critic) goes into each checkpoint's folder of its name
    and a resumed run starts from its saved state."""
    first = make_parts(tmp_path, steps=2)
    first.other_models = {"value": FakePolicy()}
    first.other_models["value"].weight = 7.5
    run(first)
    assert torch.load(tmp_path / "ckpt" / "step_2" / "value" / "weight.pt") == 7.5
    second = make_parts(tmp_path, steps=3)
    second.other_models = {"value": FakePolicy()}
    assert training_loop.restore_checkpoint(second)[0] == 2
    assert second.other_models["value"].weight == 7.5


def test_stop_signal_without_checkpointing_finishes_the_step_and_saves_nothing(
    tmp_path: Path,
) -> None:
    parts = make_parts(tmp_path, steps=7, checkpointing=False)
    with pytest.raises(RunStopped) as stop:
        run(parts, stop_after=5)  # the signal comes during step 3
    assert stop.value.step == 3 and stop.value.code == 128 + signal.SIGUSR1
    assert str(stop.value) == (
        "stopped after step 3 (received SIGUSR1); checkpointing is off "
        "(checkpointing.enabled=false): nothing was saved, a rerun starts over (exit code 138)"
    )
    assert [s for p, s, _ in parts.logger.records if p == "train"] == [1, 2, 3]
    assert not (tmp_path / "ckpt").exists()


def test_a_dead_worker_stops_the_run_naming_the_newest_checkpoint(tmp_path: Path) -> None:
    parts = make_parts(tmp_path, steps=7, save_period=2)
    with pytest.raises(ResumableFault) as fault:
        run(parts, fail_at_step=5)
    assert fault.value.exit_code == 75 and isinstance(fault.value.__cause__, WorkerDied)
    assert str(fault.value) == (
        "policy worker rank 1 on node2 (10.0.0.2) died during train (its node has died); the "
        f"newest checkpoint is {tmp_path / 'ckpt' / 'step_4'}: rerun the same command to "
        "resume from it (exit code 75)"
    )
    # the rerun resumes from step 4
    second = make_parts(tmp_path, steps=7, save_period=2)
    run(second)
    assert [s for p, s, _ in second.logger.records if p == "train"] == [5, 6, 7]


def test_a_dead_worker_without_checkpointing_says_nothing_was_saved(tmp_path: Path) -> None:
    with pytest.raises(RunFault) as fault:
        run(make_parts(tmp_path, steps=7, checkpointing=False), fail_at_step=2)
    assert not isinstance(fault.value, ResumableFault) and fault.value.exit_code == 1
    assert str(fault.value).endswith(
        "(its node has died); checkpointing is off (checkpointing.enabled=false): nothing was "
        "saved, a rerun starts over"
    )


@pytest.mark.parametrize("handed_on", ["thread", "ray"])
def test_a_fault_handed_on_is_named_with_the_newest_checkpoint(
    tmp_path: Path, handed_on: str
) -> None:
    """A fault raised in another thread (async GRPO's collector: ``raise ... from``) or in a
    Ray task (kept as the task error's ``cause``) stops the run with the same line."""
    parts = make_parts(tmp_path, steps=3, save_period=2)
    run(parts)
    died = ResumableFault("vLLM engine 0 on node1 (10.0.0.1) died (its worker process has died)")

    class TaskError(RuntimeError):  # Ray's wrapper of a remote error
        cause = died

    with pytest.raises(ResumableFault) as fault:
        with training_loop.stop_guard(parts):
            if handed_on == "ray":
                raise TaskError("remote traceback")
            try:
                raise died
            except ResumableFault as err:
                raise RuntimeError("the rollout collector failed") from err
    assert fault.value.__cause__ is died and fault.value.exit_code == 75
    assert str(fault.value) == (
        f"{died}; the newest checkpoint is {tmp_path / 'ckpt' / 'step_3'}: rerun the same "
        "command to resume from it (exit code 75)"
    )
    with pytest.raises(ValueError, match="a bug"):  # anything else passes as it is
        with training_loop.stop_guard(parts):
            raise ValueError("a bug")
