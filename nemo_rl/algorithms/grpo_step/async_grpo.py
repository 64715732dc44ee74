"""Async GRPO: a collector generates the next steps' rollouts while the policy trains.

:class:`AsyncRollouts` is the GRPO step's rollout source in async mode
(``grpo.async_grpo.enabled``): the step takes its batch from a
:class:`~.replay_buffer.ReplayBuffer` instead of generating it, and trains inside
:meth:`AsyncRollouts.training`, which publishes the new weights version.

**The collector is a driver thread, not a Ray actor.** The rollout already runs in the driver
(the generation facade, the tokenizer, the environments' handles); its time is spent waiting
on the engines' and environments' actors, which releases the GIL, so a thread overlaps it with
the trainer's waits on the policy workers at no cost. An actor would need the facade, the
tokenizer and the environments shipped to it and the batches shipped back, for nothing.

**Rules** (``t`` counts generation batches from the resumed step on; batch ``t`` is meant for
training step ``t``; the version is the number of training steps applied to the weights):

- the collector starts batch ``t`` only once the weights reach version
  ``t - max_trajectory_age_steps``, and refits the engines first when they are behind: so the
  refit falls between two generation batches, and the buffer holds at most
  ``max_trajectory_age_steps + 1`` batches;
- the trainer takes the oldest batch no older than the bound (older ones are dropped and
  counted: ``async/stale_groups_dropped``); with bound 0 the order of generations and updates
  is the synchronous loop's;
- the policy's workers are used by one thread at a time (one re-entrant lock around every
  policy call: the trainer's logprobs, training and checkpoint saves, the collector's refit).
  A refit therefore stops the trainer for the refit's length only, and the collectives of
  two calls never interleave on the workers;
- a generation batch that takes longer than ``rollout_timeout_s`` (a hung environment, a
  runaway generation) is abandoned in its thread, counted (``async/timed_out_rollouts``) and
  replaced by the next prompts;
- an engine that dies under a generation batch is restarted and the batch redone
  (:mod:`~.engine_recovery`); before the redo every engine takes the latest weights
  (:meth:`AsyncRollouts.refit_after_restart`), so the redone batch may be newer than the
  version it is recorded under (which only makes it look older to the age bound);
- **checkpoints drain the buffer by rule**: a checkpoint saves the loader position and engine
  sampling step from before the first batch the trainer has not taken, so a resumed run
  regenerates the buffered prompts with its restored weights (nothing in flight is saved, and
  no prompt is skipped). With bound 0 the resumed run is the uninterrupted one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nemo_rl.algorithms.grpo_config import AsyncGRPOConfig
from nemo_rl.algorithms.grpo_step.replay_buffer import BufferClosed, ReplayBuffer, Trajectories
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.grouped_rollouts import RolloutCarry

RollOut = Callable[[BatchedDataDict], tuple[Any, RolloutCarry]]
"""Rolls out one batch of prompts: ``(batch handle, carry)``."""


class RolloutTimeout(Exception):
    """A generation batch ran past ``rollout_timeout_s``."""


def run_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread; its result, or :class:`RolloutTimeout` after
    ``timeout_s`` seconds (the thread is abandoned: its result is discarded when it ends)."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # handed to the caller
            out["error"] = err

    thread = threading.Thread(target=target, name="rollout", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RolloutTimeout(f"rollout still running after {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


class LockedPolicy:
    """The policy facade with every method call made under ``lock`` (re-entrant), so the
    trainer's and the collector's calls reach the workers one at a time."""

    def __init__(self, policy: Any, lock: threading.RLock) -> None:
        self._policy = policy
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._policy, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return locked


class AsyncRollouts:
    """The collector thread, its buffer, and the trainer's side (see the module docstring).

    Args:
        roll_out: rolls out one batch of prompts (called in the collector's threads).
        refit: copies the policy's current weights into the engines (called under
            ``policy_lock``).
        loader: the prompt loader (``state_dict()``); its batches come through the iterator
            handed to :meth:`take`.
        sampling_step: the engines' sampling step now (a resume point's second half).
        cfg: ``grpo.async_grpo``.
        start_step: the weights version at the start (the resumed step).
        engines_current: whether the engines already hold that version's weights.
        policy_lock: the lock of the run's :class:`LockedPolicy`.
    """

    def __init__(
        self,
        roll_out: RollOut,
        refit: Callable[[], None],
        loader: Any,
        sampling_step: Callable[[], int],
        cfg: AsyncGRPOConfig,
        start_step: int,
        engines_current: bool,
        policy_lock: threading.RLock,
    ) -> None:
        self.roll_out, self.refit, self.loader = roll_out, refit, loader
        self.sampling_step, self.cfg = sampling_step, cfg
        self.max_age = cfg.max_trajectory_age_steps
        self.buffer = ReplayBuffer(self.max_age + 1)
        self.version = start_step
        self.engine_version: int | None = start_step if engines_current else None
        self.policy_lock = policy_lock
        self.engine_lock = threading.Lock()
        self.timed_out_rollouts = 0
        self._reported = {"stale": 0, "timed_out": 0}
        # (loader state, sampling step) before each batch the trainer has not taken, oldest
        # first; the batch being generated (not in the buffer yet) is _in_flight
        self._pending: deque[tuple[dict[str, Any], int]] = deque()
        self._in_flight: tuple[dict[str, Any], int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- trainer side -------------------------------------------------------------------

    def take(
        self, components: Any, store: Any, batches: Iterator[BatchedDataDict]
    ) -> tuple[Any, RolloutCarry, dict[str, float]]:
        """The batch for the trainer's current step (starting the collector on ``batches``
        at the first call); waits while the collector is behind.

        Returns:
            ``(batch, carry, metrics)``: ``async/trajectory_age`` (steps), and since the last
            call ``async/stale_groups_dropped`` and ``async/timed_out_rollouts``. The wait is
            timed as ``rollout_wait`` on ``components.timer``.

        Raises:
            BufferClosed: the collector failed (its error chained).
        """
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._collect, args=(batches,), name="async-grpo-collector", daemon=True
            )
            self._thread.start()
        with components.timer.time("rollout_wait"):
            item, dropped = self.buffer.take(self.version, self.max_age)
        with self.buffer.cond:
            for _ in range(dropped + 1):
                self._pending.popleft()
        return item.batch, item.carry, self._metrics(self.version - item.version)

    def _metrics(self, age: int) -> dict[str, float]:
        stale, timed_out = self.buffer.stale_groups_dropped, self.timed_out_rollouts
        metrics = {
            "async/trajectory_age": float(age),
            "async/stale_groups_dropped": float(stale - self._reported["stale"]),
            "async/timed_out_rollouts": float(timed_out - self._reported["timed_out"]),
        }
        self._reported = {"stale": stale, "timed_out": timed_out}
        return metrics

    @contextmanager
    def training(self, components: Any) -> Iterator[None]:
        """The body (logprobs, training) holds the policy; afterwards the weights are one
        version newer and the collector may go on."""
        with self.policy_lock:
            yield
            with self.buffer.cond:
                self.version += 1
                self.buffer.cond.notify_all()

    @contextmanager
    def engines(self) -> Iterator[None]:
        """The engines, with the latest weights, for the body alone (a validation): the
        collector waits meanwhile."""
        with self.engine_lock:
            self._refit_if_behind()
            yield

    def resume_point(self) -> tuple[dict[str, Any], int]:
        """Loader state and engine sampling step from before the first batch the trainer has
        not taken (what a checkpoint saves: see the module docstring)."""
        with self.buffer.cond:
            oldest = self._pending[0] if self._pending else self._in_flight
            if oldest is not None:
                return dict(oldest[0]), oldest[1]
            return dict(self.loader.state_dict()), self.sampling_step()

    def close(self) -> None:
        """Stop the collector (an abandoned rollout thread ends on its own)."""
        self._stop.set()
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ---- collector side ----------------------------------------------------------------

    def _refit_if_behind(self) -> None:
        with self.policy_lock:  # the version cannot move while the weights are copied
            if self.engine_version != self.version:
                self.refit()
                self.engine_version = self.version

    def refit_after_restart(self) -> None:
        """In the collector, after an engine died under its batch and was restarted: every
        engine takes the latest weights (the restarted one holds the checkpoint's)."""
        with self.policy_lock:
            self.refit()
            self.engine_version = self.version

    def _collect(self, batches: Iterator[BatchedDataDict]) -> None:
        try:
            target = self.version
            while not self._stop.is_set():
                with self.buffer.cond:
                    while self.version < target - self.max_age and not self._stop.is_set():
                        self.buffer.cond.wait()
                    if self._stop.is_set():
                        return
                if self._generate(batches):
                    target += 1
        except BufferClosed:
            return
        except BaseException as err:  # the trainer raises it from take()
            self.buffer.close(err)

    def _generate(self, batches: Iterator[BatchedDataDict]) -> bool:
        """One generation batch into the buffer (False: it timed out, its prompts skipped)."""
        with self.engine_lock:
            self._refit_if_behind()
            version = self.engine_version
            with self.buffer.cond:
                self._in_flight = (dict(self.loader.state_dict()), self.sampling_step())
            prompts = next(batches)
            try:
                batch, carry = run_with_deadline(
                    lambda: self.roll_out(prompts), self.cfg.rollout_timeout_s
                )
            except RolloutTimeout:
                with self.buffer.cond:
                    self.timed_out_rollouts += 1
                    self._in_flight = None
                return False
        assert version is not None
        with self.buffer.cond:
            self._pending.append(self._in_flight)
            self._in_flight = None
        self.buffer.put(Trajectories(batch, carry, version))
        return True


class ResumeCursor:
    """The prompt loader as the training loop sees it in async mode: batches from the loader,
    but its checkpointed state is :meth:`AsyncRollouts.resume_point`'s (the position of the
    first batch the trainer has not taken, not the collector's)."""

    def __init__(self, source: AsyncRollouts) -> None:
        self.source = source

    def __iter__(self) -> Iterator[BatchedDataDict]:
        return iter(self.source.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.source.resume_point()[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.loader.load_state_dict(state)
