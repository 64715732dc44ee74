"""A synchronous rollout-trained command with a second model beside the policy
(distillation's teacher, PPO's critic): start the run with that model on the policy's bundles
(:func:`start_with_second_model`), train in the shared loop with the batches in driver memory
(:func:`train_in_memory`), then shut everything down and report (:func:`run_in_memory`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nemo_rl.algorithms import rollout_run, training_loop
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.step import validate
from nemo_rl.algorithms.rollout_config import RolloutMasterConfig
from nemo_rl.algorithms.rollout_inputs import load_run_inputs
from nemo_rl.algorithms.rollout_run import RolloutComponents
from nemo_rl.models.policy.config import PolicyConfig

InMemoryStepFn = Callable[[InMemoryBatchStore, Any], dict[str, float]]
"""One training step: ``(store, batches) -> metrics``."""


def start_with_second_model(
    cfg: RolloutMasterConfig, model_cfg: PolicyConfig, name: str, trained: bool
) -> tuple[dict[str, Any], Any]:
    """The policy's run (:func:`~nemo_rl.algorithms.rollout_run.start_rollout_run`, no
    reference policy) and a second Megatron policy of ``model_cfg`` on the policy's bundles,
    started with the policy (before engines colocated on GPUs, which size their KV cache from
    the memory left).

    Args:
        name: what the second model's workers are called in fault messages.
        trained: the second model has an optimizer (PPO's critic); False: frozen, it only
            scores (distillation's teacher).

    Returns:
        The fields of :class:`~nemo_rl.algorithms.rollout_run.RolloutComponents`
        (``checkpointer`` and ``timer`` included) and the second model.

    Raises:
        ConfigError: before anything starts, when the latest checkpoint was trained on another
            model or data than ``cfg`` names.
    """
    from nemo_rl.models.policy.lm_policy import Policy
    from nemo_rl.utils.timer import Timer

    checkpointer = training_loop.open_checkpointer(cfg)
    inputs = load_run_inputs(cfg)
    parts, (model,) = rollout_run.start_rollout_run(
        cfg,
        inputs,
        init_reference_model=False,
        extra_train_workers=[
            lambda cluster: Policy(
                cluster,
                model_cfg,
                init_reference_model=False,
                seed=cfg.loop.seed,
                init_optimizer=trained,
                name=name,
            )
        ],
    )
    return {**parts, "checkpointer": checkpointer, "timer": Timer()}, model


def train_in_memory(
    components: RolloutComponents,
    step_fn: InMemoryStepFn,
    resumed: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Resume (policy and :meth:`~nemo_rl.algorithms.rollout_run.RolloutComponents.
    checkpointed_models`; or step 0), tell ``resumed`` the step, and run ``step_fn`` to the loop
    section's ``max_num_steps`` in the shared
    :func:`~nemo_rl.algorithms.training_loop.train_loop`, validating with GRPO's
    :func:`~nemo_rl.algorithms.grpo_step.step.validate`; returns the last step's metrics plus
    the last validation's (``val_`` prefixed)."""
    parts = rollout_run.loop_parts(components)
    with training_loop.stop_guard(parts) as guard:
        step = rollout_run.restore_rollout_checkpoint(components)
        if resumed is not None:
            resumed(step)
        store = InMemoryBatchStore(components.rollout_runner(), components.policy)
        return training_loop.train_loop(
            parts,
            guard,
            step,
            step_fn=lambda batches: step_fn(store, batches),
            validate_fn=(lambda: validate(components, store)) if components.val_batches else None,
            extra_info=lambda metrics: rollout_run.checkpoint_info(components, metrics),
        )


def run_in_memory(
    components: RolloutComponents,
    step_fn: InMemoryStepFn,
    other_workers: Sequence[Any],
    curves: tuple[tuple[str, str], tuple[str, str]],
    resumed: Callable[[int], None] | None = None,
) -> int | None:
    """A set-up run's command body: :func:`train_in_memory`, then stop ``other_workers`` (the
    worker groups started beside the policy) and everything
    :func:`~nemo_rl.algorithms.rollout_run.shutdown` stops, and report (plot of ``curves``).

    Returns:
        None when the run finished; 75 when it saved and stopped early (see
        :func:`~nemo_rl.algorithms.rollout_run.run_rollout_command`).
    """

    def stop() -> None:
        for workers in other_workers:
            workers.shutdown()
        rollout_run.shutdown(components)

    return rollout_run.run_rollout_command(
        components, lambda: train_in_memory(components, step_fn, resumed), stop, curves
    )
