"""The training loop every algorithm shares: resume, steps, validation, checkpoints, stop rule.

An algorithm (GRPO, SFT, DPO) gives its step and validation functions; this module runs them
from the resumed step to ``max_num_steps`` with the same logging, checkpoint contents and early
stop for all of them:

- :func:`restore_checkpoint` loads the checkpoint the manager picks (policy, data loader
  position, driver RNG) and returns its step and training info.
- :func:`train_loop` runs validation at the start (``val_at_start``, fresh runs only), then per
  step: the step inside :meth:`~nemo_rl.utils.logger.Logger.step_progress`, train and timing
  metrics, validation every ``val_period`` steps, and the save / stop rule of
  :mod:`nemo_rl.utils.run_stop` (with checkpointing: save every ``save_period`` steps and at the
  last; after a stop signal or near ``checkpoint_must_save_by``, save the finished step and
  raise :class:`~nemo_rl.utils.run_stop.RunStopped`, exit code 75; without: after a stop
  signal, stop after the step, saving nothing, exit code 128 + the signal).
- :func:`stop_guard` holds the stop signals for the whole training (resume, warm start, loop)
  and turns a fault a rerun gets past (a dead or hung worker) into one line naming the newest
  checkpoint (:func:`~nemo_rl.utils.run_stop.fault_stop`).
- :func:`save_checkpoint` writes policy, loader position, RNG and the resolved recipe.
- :func:`report_finished` prints the final metrics and where logs and checkpoints are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import BaseModel

from nemo_rl.utils import fault_injection
from nemo_rl.utils.errors import ResumableFault, reported_error_of
from nemo_rl.utils.run_config import check_resume, save_run_config
from nemo_rl.utils.run_stop import RunStopped, StopGuard, fault_stop

Metrics = dict[str, float]


@dataclass
class LoopParts:
    """What the shared loop reads and writes of a run.

    Attributes:
        cfg: the run's validated master config (saved as the checkpoint's ``config.yaml``; its
            ``checkpointing`` section drives saving and stopping).
        policy: the trained :class:`~nemo_rl.models.policy.lm_policy.Policy`.
        train_loader: a resumable loader (``__iter__``, ``state_dict``, ``load_state_dict``).
        logger: the run's :class:`~nemo_rl.utils.logger.Logger`.
        timer: the run's :class:`~nemo_rl.utils.timer.Timer` (phases of a step).
        checkpointer: the :class:`~nemo_rl.utils.checkpoint.CheckpointManager`; None without
            checkpointing.
        max_num_steps: the last step of the run.
        val_period: validate every this many steps; 0 never.
        val_at_start: validate once before the first step of a fresh run.
        other_models: further trained models saved and restored with the policy, each in the
            checkpoint's subfolder of its name (PPO's critic: ``{"value": critic}``); each
            has the policy's ``save_checkpoint(path)`` / ``load_checkpoint(path)``.
    """

    cfg: BaseModel
    policy: Any
    train_loader: Any
    logger: Any
    timer: Any
    checkpointer: Optional[Any]
    max_num_steps: int
    val_period: int
    val_at_start: bool
    other_models: dict[str, Any] = field(default_factory=dict)


def loop_parts(
    run: Any, loop: Any, max_num_steps: int, other_models: dict[str, Any] | None = None
) -> LoopParts:
    """The :class:`LoopParts` of ``run`` (anything with ``cfg``, ``policy``, ``train_loader``,
    ``logger``, ``timer`` and ``checkpointer``), validating by ``loop``'s ``val_period`` and
    ``val_at_start`` (the algorithm's loop section), checkpointing ``other_models`` with the
    policy."""
    return LoopParts(
        cfg=run.cfg,
        policy=run.policy,
        train_loader=run.train_loader,
        logger=run.logger,
        timer=run.timer,
        checkpointer=run.checkpointer,
        max_num_steps=max_num_steps,
        val_period=loop.val_period,
        val_at_start=loop.val_at_start,
        other_models=dict(other_models or {}),
    )


def open_checkpointer(cfg: BaseModel) -> Optional[Any]:
    """The run's :class:`~nemo_rl.utils.checkpoint.CheckpointManager` (None without
    checkpointing), its resume check started in the background.

    Raises:
        ConfigError: before anything starts, when the latest checkpoint was trained on another
            model or data than ``cfg`` names (:func:`~nemo_rl.utils.run_config.check_resume`).
    """
    from nemo_rl.utils.checkpoint import CheckpointManager

    if not cfg.checkpointing.enabled:
        return None
    checkpointer = CheckpointManager(cfg.checkpointing)
    latest = checkpointer.get_latest_checkpoint_path()
    if latest is not None:
        check_resume(latest, cfg)  # before Ray: a changed model or data is refused at once
    checkpointer.start_resume_check()  # hashing overlaps the run's set-up
    return checkpointer


StepFn = Callable[[Iterator[Any]], Metrics]
"""One training step: takes the loader's batch iterator, returns the step's train metrics."""

ValidateFn = Callable[[], Metrics]
"""One validation: returns its metrics (logged under ``validation``)."""

CheckpointInfoFn = Callable[[Metrics], dict[str, Any]]
"""Extra training-info entries of a checkpoint, given the entries the loop records (the last
validation's metrics ``val_``-prefixed and the step's train metrics ``train_``-prefixed)."""


def save_checkpoint(
    parts: LoopParts,
    step: int,
    val_metrics: Metrics,
    train_metrics: Metrics,
    extra_info: CheckpointInfoFn | None = None,
) -> Path:
    """Policy (model, optimizer, scheduler, RNG), the other models (``parts.other_models``),
    data loader position, driver RNG and the resolved recipe (``config.yaml``) of ``step``
    into a new checkpoint folder.

    The manager keeps the top-k and the latest, ranked by ``checkpointing.metric_name`` among the
    last validation's metrics (``val_`` prefixed) and the step's train metrics (``train_``
    prefixed), plus what ``extra_info`` adds.
    """
    from nemo_rl.utils.checkpoint import (
        DATALOADER_STATE_FILE,
        POLICY_DIR,
        RNG_STATE_FILE,
        save_rng_state,
    )

    metrics = {
        **{f"val_{k}": v for k, v in val_metrics.items()},
        **{f"train_{k}": v for k, v in train_metrics.items()},
    }
    info = {"step": step, **(extra_info(metrics) if extra_info is not None else {}), **metrics}
    manager = parts.checkpointer
    path = manager.init_tmp_checkpoint(step, info)
    save_run_config(path, parts.cfg)
    parts.policy.save_checkpoint(str(path / POLICY_DIR))
    for name, model in parts.other_models.items():
        model.save_checkpoint(str(path / name))
    torch.save(parts.train_loader.state_dict(), path / DATALOADER_STATE_FILE)
    save_rng_state(path / RNG_STATE_FILE)
    return manager.finalize_checkpoint(path)


def restore_checkpoint(
    parts: LoopParts, before_policy_load: Callable[[Path], None] | None = None
) -> tuple[int, dict[str, Any]]:
    """Load the checkpoint :meth:`~nemo_rl.utils.checkpoint.CheckpointManager.resume_checkpoint`
    picks (verified against its manifest): policy, the other models, loader position, driver RNG.

    Args:
        before_policy_load: called with the checkpoint folder before its policy loads (e.g. to
            rebuild a reference policy from other weights first).

    Returns:
        ``(step, training info)`` of the checkpoint; ``(0, {})`` without one.

    Raises:
        CheckpointError: ``checkpointing.resume_from`` names a missing or damaged checkpoint.
    """
    from nemo_rl.utils.checkpoint import (
        DATALOADER_STATE_FILE,
        POLICY_DIR,
        RNG_STATE_FILE,
        CheckpointManager,
        load_rng_state,
    )

    manager = parts.checkpointer
    latest = manager.resume_checkpoint() if manager is not None else None
    if latest is None:
        return 0, {}
    if before_policy_load is not None:
        before_policy_load(latest)
    parts.policy.load_checkpoint(str(latest / POLICY_DIR))
    for name, model in parts.other_models.items():
        model.load_checkpoint(str(latest / name))
    parts.train_loader.load_state_dict(torch.load(latest / DATALOADER_STATE_FILE))
    load_rng_state(latest / RNG_STATE_FILE)
    info = CheckpointManager.load_training_info(latest)
    print(f"resumed from {latest} (step {info['step']})")
    return int(info["step"]), info


@contextmanager
def stop_guard(parts: LoopParts) -> Iterator[StopGuard]:
    """The run's :class:`~nemo_rl.utils.run_stop.StopGuard` while the ``with`` body runs
    (``checkpointing.stop_signals``; ``checkpoint_must_save_by`` only with checkpointing).

    Raises:
        ResumableFault: (exit 75) a fault a rerun gets past (a dead or hung worker, an engine
            dead past its restarts) ended the body, raised there or handed on (a Ray task's
            error, a collector thread's error chained by ``raise ... from``): its message plus
            the newest checkpoint a rerun resumes from.
        RunFault: (exit 1) the same fault without checkpointing: nothing was saved.
    """
    ckpt = parts.cfg.checkpointing
    checkpointing = parts.checkpointer is not None
    save_by = ckpt.must_save_by_seconds() if checkpointing else None
    try:
        with StopGuard(ckpt.stop_signals, save_by) as guard:
            yield guard
    except Exception as err:
        fault = reported_error_of(err)
        if not isinstance(fault, ResumableFault):
            raise
        latest = parts.checkpointer.get_latest_checkpoint_path() if checkpointing else None
        raise fault_stop(fault, checkpointing, latest) from fault


def train_loop(
    parts: LoopParts,
    guard: StopGuard | None,
    start_step: int,
    step_fn: StepFn,
    validate_fn: ValidateFn | None,
    extra_info: CheckpointInfoFn | None = None,
) -> Metrics:
    """Run ``step_fn`` from ``start_step`` to ``parts.max_num_steps`` (see the module docstring).

    Args:
        guard: from :func:`stop_guard`; None: no stop rule (signals keep their effect).
        start_step: the step the run resumed at (0 for a fresh run).
        validate_fn: None when the run has no validation data.
        extra_info: extra training-info entries of each checkpoint.

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).

    Raises:
        RunStopped: a stop signal or ``checkpoint_must_save_by`` ended the run early.
    """
    logger, timer = parts.logger, parts.timer
    step = start_step
    last: Metrics = {}
    val_metrics: Metrics = {}
    if parts.val_at_start and step == 0 and validate_fn is not None:
        val_metrics = validate_fn()
        logger.log_metrics(val_metrics, step, "validation")
    if guard is not None and (reason := guard.stop_reason()) is not None:
        raise _stopped(parts, guard, reason, step)  # signalled before the first step
    batches = iter(parts.train_loader)
    while step < parts.max_num_steps:
        started = time.monotonic()
        fault_injection.enter_step(step + 1)  # test-only: faults armed for "step N"
        with logger.step_progress(step + 1, parts.max_num_steps, timer):
            last = step_fn(batches)
        step += 1
        logger.log_metrics(last, step, "train")
        timing = {**timer.summary(), "total_step_time": time.monotonic() - started}
        logger.log_metrics(timing, step, "timing/train")
        timer.reset()
        if parts.val_period and step % parts.val_period == 0 and validate_fn is not None:
            val_metrics = validate_fn()
            logger.log_metrics(val_metrics, step, "validation")
        if guard is not None:
            guard.step_finished(time.monotonic() - started)
            _save_or_stop(parts, guard, step, val_metrics, last, extra_info)
    return {**last, **{f"val_{k}": v for k, v in val_metrics.items()}}


def _save_or_stop(
    parts: LoopParts,
    guard: StopGuard,
    step: int,
    val_metrics: Metrics,
    train_metrics: Metrics,
    extra_info: CheckpointInfoFn | None,
) -> None:
    """After ``step``: with checkpointing, save on ``save_period`` and at the last step; then,
    when a stop signal came or ``checkpoint_must_save_by`` is near, save the step (if not just
    saved) and raise :class:`~nemo_rl.utils.run_stop.RunStopped` (without checkpointing: raise
    it, saving nothing).
    """

    def save() -> None:
        started = time.monotonic()
        save_checkpoint(parts, step, val_metrics, train_metrics, extra_info)
        guard.save_finished(time.monotonic() - started)

    final_step = step == parts.max_num_steps
    checkpointing = parts.checkpointer is not None
    due = checkpointing and (step % parts.cfg.checkpointing.save_period == 0 or final_step)
    if due:
        save()
    reason = guard.stop_reason()
    if reason is None or final_step:
        return
    if checkpointing and not due:
        save()
    raise _stopped(parts, guard, reason, step)


def _stopped(parts: LoopParts, guard: StopGuard, reason: str, step: int) -> RunStopped:
    """The stop after ``step`` for ``reason``: exit 75 with checkpointing (the step is saved),
    128 + the signal number without (nothing is saved)."""
    if parts.checkpointer is not None:
        return RunStopped(reason, step)
    signum = guard.received_signal
    return RunStopped(reason, step, checkpointing=False,
                      exit_code=128 + int(signum) if signum is not None else 1)


def report_finished(
    parts: LoopParts,
    final: Metrics,
    plot_name: str,
    curves: tuple[tuple[str, str], tuple[str, str]],
) -> None:
    """Print the final metrics and where the logs, the plot of the two ``curves`` (each
    ``(prefix, metric)``; written as ``plot_name`` under ``logger.log_dir``) and the
    checkpoints are."""
    from nemo_rl.utils.plot import plot_training_curves

    log_dir = Path(parts.cfg.logger.log_dir)
    plot = plot_training_curves(parts.logger.metrics_path, log_dir / plot_name, *curves)
    print(f"final metrics: { {k: round(v, 4) for k, v in final.items()} }")
    print(f"logs: {log_dir}  plot: {plot}")
    if parts.checkpointer is not None:
        print(f"checkpoints: {parts.cfg.checkpointing.checkpoint_dir}")
