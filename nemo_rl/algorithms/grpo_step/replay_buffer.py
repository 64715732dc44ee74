"""The replay buffer of async GRPO: generation batches waiting for the trainer, each tagged
with the weights version that generated it.

The collector (:mod:`~nemo_rl.algorithms.grpo_step.async_grpo`) puts, the trainer takes;
both block on one condition variable, and either side's failure (:meth:`ReplayBuffer.close`)
wakes the other instead of leaving it waiting forever.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from nemo_rl.experience.grouped_rollouts import RolloutCarry


class BufferClosed(RuntimeError):
    """The buffer was closed: the run is ending, or the collector failed (the cause is
    chained)."""


@dataclass(frozen=True)
class Trajectories:
    """One generation batch of rollout groups.

    Attributes:
        batch: the batch store's handle of the samples (``[B, S]`` training fields).
        carry: their per-sample scalars ``[B]``.
        version: the weights version (training steps applied) the engines held when they
            generated it.
    """

    batch: Any
    carry: RolloutCarry
    version: int

    @property
    def num_groups(self) -> int:
        """Prompt groups of the batch."""
        return len(set(self.carry.group_ids.tolist()))


class ReplayBuffer:
    """A bounded FIFO of :class:`Trajectories`.

    Args:
        capacity: most batches held; :meth:`put` waits for room.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ReplayBuffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.cond = threading.Condition()
        self._entries: deque[Trajectories] = deque()
        self._closed: BaseException | None = None
        self.stale_groups_dropped = 0

    def __len__(self) -> int:
        with self.cond:
            return len(self._entries)

    def close(self, cause: BaseException | None = None) -> None:
        """Wake every waiter; later :meth:`put` and :meth:`take` raise :class:`BufferClosed`
        (from ``cause`` when given)."""
        with self.cond:
            self._closed = cause if cause is not None else BufferClosed("replay buffer closed")
            self.cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed is None:
            return
        if isinstance(self._closed, BufferClosed):
            raise self._closed
        raise BufferClosed(f"the rollout collector failed: {self._closed!r}") from self._closed

    def put(self, item: Trajectories) -> None:
        """Append ``item``, waiting while the buffer is full.

        Raises:
            BufferClosed: the buffer was closed before there was room.
        """
        with self.cond:
            while len(self._entries) >= self.capacity and self._closed is None:
                self.cond.wait()
            self._raise_if_closed()
            self._entries.append(item)
            self.cond.notify_all()

    def take(self, step: int, max_age: int) -> tuple[Trajectories, int]:
        """The oldest batch no more than ``max_age`` versions older than ``step`` (the
        trainer's weights version), waiting for one; older batches met first are dropped.

        Returns:
            ``(batch, dropped)``: ``dropped`` counts the batches dropped for their age by this
            call (their groups are added to :attr:`stale_groups_dropped`).

        Raises:
            BufferClosed: the buffer was closed (a collector failure is chained).
        """
        dropped = 0
        with self.cond:
            while True:
                while not self._entries and self._closed is None:
                    self.cond.wait()
                if not self._entries:
                    self._raise_if_closed()
                item = self._entries.popleft()
                self.cond.notify_all()
                if step - item.version <= max_age:
                    return item, dropped
                dropped += 1
                self.stale_groups_dropped += item.num_groups
