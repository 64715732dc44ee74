"""Stopping a training loop early so that a rerun continues it: on a signal, or before a deadline.

The rule (also in docs/cluster.md): a stop signal (``checkpointing.stop_signals``: SIGTERM and
SIGUSR1 by default) never cuts a step; the loop finishes the step under way (with its
validation, if one is due), saves a checkpoint of it unless that step is already saved, stops
every actor and exits with :data:`RESUMABLE_EXIT_CODE`. So the driver exits within one step, one
validation and one save of the signal (a signal before the first step stops without a new
checkpoint). The same signal a second time stops at once: no save, the actors are still
stopped, exit code 128 + the signal number; the newest checkpoint is then the last saved.

``checkpointing.checkpoint_must_save_by`` stops the same way when, after a step, the time since
the loop started plus the longest step and the longest save so far (the longest step while no
save has been timed) would pass the limit.

With checkpointing off (``checkpointing.enabled=false``) a stop signal still never cuts a step:
the loop finishes the step under way, saves nothing and exits with 128 + the signal number
(143 for SIGTERM), saying that nothing was saved; a second signal stops at once as above.

A fault of the run's machinery that a rerun gets past (a
:class:`~nemo_rl.utils.errors.ResumableFault`: a worker that died or hung) stops the run with
its one line plus the newest checkpoint a rerun resumes from (:func:`fault_stop`), exit code 75.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from nemo_rl.utils.errors import ResumableFault, RunFault

# sysexits' EX_TEMPFAIL: the run stopped after saving a checkpoint; rerunning continues it.
RESUMABLE_EXIT_CODE = 75


class RunStopped(SystemExit):
    """The loop stopped early after a step (saving it, with checkpointing); exits the process
    with ``exit_code``: 75 with checkpointing (a rerun continues), 128 + the signal number
    without (a rerun starts over)."""

    def __init__(
        self,
        reason: str,
        step: int,
        checkpointing: bool = True,
        exit_code: int = RESUMABLE_EXIT_CODE,
    ) -> None:
        super().__init__(exit_code)
        self.reason = reason
        self.step = step
        self.checkpointing = checkpointing

    def __str__(self) -> str:
        where = (
            "before the first step" if self.step == 0 else f"after step {self.step}"
        )
        if not self.checkpointing:
            return (
                f"stopped {where} ({self.reason}); checkpointing is off "
                "(checkpointing.enabled=false): nothing was saved, a rerun starts over (exit "
                f"code {self.code})"
            )
        if self.step == 0:
            return (
                f"stopped {where} ({self.reason}); rerun the same command to start (exit "
                f"code {self.code})"
            )
        return (
            f"stopped {where} ({self.reason}); its checkpoint is saved, rerun the same command "
            f"to continue (exit code {self.code})"
        )


def fault_stop(fault: ResumableFault, checkpointing: bool, latest: Path | None) -> RunFault:
    """The error the run stops with after ``fault``: its message in one line plus what a
    rerun starts from.

    Args:
        checkpointing: whether the run saves checkpoints.
        latest: the newest checkpoint folder (``step_<n>``), None when none is saved yet.

    Returns:
        A :class:`~nemo_rl.utils.errors.ResumableFault` (exit 75) with checkpointing; a plain
        :class:`~nemo_rl.utils.errors.RunFault` (exit 1) without (a rerun starts over).
    """
    what = " ".join(str(fault).split())
    if not checkpointing:
        return RunFault(
            f"{what}; checkpointing is off (checkpointing.enabled=false): nothing was saved, a "
            "rerun starts over"
        )
    if latest is None:
        return ResumableFault(
            f"{what}; no checkpoint was saved yet: rerun the same command to start over "
            f"(exit code {RESUMABLE_EXIT_CODE})"
        )
    return ResumableFault(
        f"{what}; the newest checkpoint is {latest}: rerun the same command to resume from it "
        f"(exit code {RESUMABLE_EXIT_CODE})"
    )


class StopGuard:
    """Catches the stop signals while active (a context manager) and keeps the step and save
    times that :meth:`stop_reason` compares with the save-by limit."""

    def __init__(
        self,
        signals: list[str],
        must_save_by_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            signals: names of the signals to catch (``"SIGTERM"``...).
            must_save_by_s: seconds after :meth:`__enter__` by which the last save must end;
                None for no limit.
            clock: seconds, monotonic (a test passes a fake one).
        """
        self._signals = [signal.Signals[name] for name in signals]
        self._must_save_by_s = must_save_by_s
        self._clock = clock
        self._start = clock()
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self.longest_step_s = 0.0
        self.longest_save_s: float | None = None

    def __enter__(self) -> StopGuard:
        self._start = self._clock()
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self._received is None:
            self._received = sig
            # os.write: print() is not safe inside a handler interrupting another print
            os.write(2, f"received {sig.name}: finishing the current step, then saving a "
                     f"checkpoint and stopping ({sig.name} again stops at once, without "
                     "saving)\n".encode())
            return
        os.write(2, f"received {sig.name} again: stopping now without saving\n".encode())
        raise SystemExit(128 + signum)

    def step_finished(self, seconds: float) -> None:
        """Record a step's duration (with its validation)."""
        self.longest_step_s = max(self.longest_step_s, seconds)

    def save_finished(self, seconds: float) -> None:
        """Record a checkpoint save's duration."""
        self.longest_save_s = max(self.longest_save_s or 0.0, seconds)

    @property
    def received_signal(self) -> signal.Signals | None:
        """The stop signal received so far, if any."""
        return self._received

    def stop_reason(self) -> str | None:
        """Why the loop must stop after the step it just finished, or None to go on."""
        if self._received is not None:
            return f"received {self._received.name}"
        if self._must_save_by_s is None:
            return None
        elapsed = self._clock() - self._start
        save = self.longest_save_s if self.longest_save_s is not None else self.longest_step_s
        if elapsed + self.longest_step_s + save > self._must_save_by_s:
            return (
                f"checkpoint_must_save_by: {elapsed:.0f} s elapsed, another step "
                f"({self.longest_step_s:.0f} s) and a save ({save:.0f} s) would pass the "
                f"{self._must_save_by_s:.0f} s limit"
            )
        return None
