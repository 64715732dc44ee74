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
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

# sysexits' EX_TEMPFAIL: the run stopped after saving a checkpoint; rerunning continues it.
RESUMABLE_EXIT_CODE = 75


class RunStopped(SystemExit):
    """The loop saved a checkpoint and stopped early; exits the process with code 75."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(RESUMABLE_EXIT_CODE)
        self.reason = reason
        self.step = step

    def __str__(self) -> str:
        if self.step == 0:
            return (
                f"stopped before the first step ({self.reason}); rerun the same command to "
                f"start (exit code {RESUMABLE_EXIT_CODE})"
            )
        return (
            f"stopped after step {self.step} ({self.reason}); its checkpoint is saved, rerun the "
            f"same command to continue (exit code {RESUMABLE_EXIT_CODE})"
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
