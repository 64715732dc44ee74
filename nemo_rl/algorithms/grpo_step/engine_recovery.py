"""Redoing a generation batch that an engine's death broke.

A vLLM engine that dies under a rollout or a refit (its actor, or one of its tensor-parallel
rank processes: ``kill -9``, a crash, a lost device) fails the call; one that hangs (stopped, a
deadlock) fails it once the call's bound passed (``policy.generation.generate_timeout_s``...).
:func:`redo_on_engine_death` then restarts it on its bundles (a hung one: once it also missed
a health check)
(:meth:`~nemo_rl.models.generation.vllm.VllmGeneration.restart_dead_engines`), has the engines
take the policy's weights again and rolls the same prompts out again from the same sampling
step: with the same weights and seeds the redone batch is the one an uninterrupted run
generates (the environments are asked again: an environment step is a function of its
inputs). A death during a refit is handled by the refit itself, which restarts the engine
before its next attempt.

Each engine may be restarted ``policy.generation.max_engine_restarts`` times in a run; one
more death stops the run with :class:`~nemo_rl.models.generation.vllm.engine_health.
EngineFault`: one line naming the engine and its node, to which the training loop's
:func:`~nemo_rl.algorithms.training_loop.stop_guard` adds the newest checkpoint, exit code 75
(rerunning the command resumes from that checkpoint).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from nemo_rl.algorithms.rollout_run import RolloutComponents
from nemo_rl.models.generation.vllm.engine_health import EngineFault

logger = logging.getLogger(__name__)

T = TypeVar("T")


def redo_on_engine_death(
    components: RolloutComponents,
    attempt: Callable[[], T],
    after_restart: Callable[[], None] | None = None,
) -> T:
    """``attempt()`` (a refit if one is due, then one generation batch), done again from the
    same ``generation.sampling_step`` after ``after_restart()`` for as long as an engine died
    under it and was restarted.

    Args:
        attempt: refits the engines if they are stale, then generates; called again whole.
        after_restart: makes the next ``attempt()`` give every engine the policy's weights;
            None: :func:`refit_after_restart` (the synchronous loop's way).

    Raises:
        EngineFault: an engine died once more than allowed, or could not be restarted (the
            training loop's stop guard adds the newest checkpoint to its line).
        Whatever ``attempt`` raised when no engine had died.
    """
    generation = components.generation
    sampling_step = generation.sampling_step
    while True:
        try:
            return attempt()
        except EngineFault:  # a refit's restart that failed, or went past the bound
            raise
        except Exception:
            restarted = generation.restart_dead_engines()
            if not restarted:
                raise
            logger.warning(
                "redoing the generation batch that vLLM engine(s) %s died under", restarted
            )
            generation.sampling_step = sampling_step
            if after_restart is None:
                refit_after_restart(components)
            else:
                after_restart()


def refit_after_restart(components: RolloutComponents) -> None:
    """Make the next refit-and-generate of the synchronous loop give every engine the policy's
    weights: the engines are put to sleep and, colocated, the policy's weights (offloaded after
    the last refit) brought back to its devices, as before a step's refit."""
    components.generation.finish_generation()
    if components.cfg.policy.generation.colocated.enabled:
        components.policy.prepare_for_training()
    components.generation_stale = True
