"""Wall-clock timing of named, possibly nested, phases of a training step.

``with timer.time("generation"):`` measures one phase; phases may nest (an outer
``"total_step_time"`` around inner ``"generation"``, ``"policy_training"``, ...), and each name
is its own entry: an outer phase's seconds include its inner phases'. A name entered several
times in one step accumulates. :meth:`Timer.summary` gives ``{phase: seconds}`` of the step and
:meth:`Timer.reset` starts the next one.

Listeners (``listener(event, name, seconds)``) see every phase start (``"start"``, seconds 0.0)
and end (``"stop"``, the phase's seconds); the console progress display of
:class:`nemo_rl.utils.logger.Logger` is one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

PhaseEvent = Literal["start", "stop"]
PhaseListener = Callable[[PhaseEvent, str, float], None]


class Timer:
    """Accumulates seconds per phase name until :meth:`reset`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._active: list[str] = []
        self._listeners: list[PhaseListener] = []

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the ``with`` body as phase ``name`` (its seconds are added to the name's total).

        Raises:
            ValueError: ``name`` is already being timed (a phase cannot contain itself).
        """
        if name in self._active:
            raise ValueError(
                f"timer phase {name!r} is already running (active: {' > '.join(self._active)}); "
                "nested phases need distinct names"
            )
        self._active.append(name)
        for listener in list(self._listeners):
            listener("start", name, 0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self._active.remove(name)
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds
            for listener in list(self._listeners):
                listener("stop", name, seconds)

    @property
    def active_phases(self) -> list[str]:
        """Names of the phases running now, outermost first."""
        return list(self._active)

    def summary(self) -> dict[str, float]:
        """``{phase: seconds}`` accumulated since the last :meth:`reset`, in first-entry order."""
        return dict(self._seconds)

    def reset(self) -> None:
        """Forget the accumulated seconds (phases running now keep running and are recorded)."""
        self._seconds.clear()

    def add_listener(self, listener: PhaseListener) -> None:
        """Call ``listener(event, name, seconds)`` at every phase start and stop."""
        self._listeners.append(listener)

    def remove_listener(self, listener: PhaseListener) -> None:
        """Stop calling ``listener`` (it must have been added)."""
        self._listeners.remove(listener)
