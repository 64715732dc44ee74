"""One GRPO stack (Ray clusters, policy workers, vLLM engines) kept for several GRPO runs of the
same shape, so that each run after the first pays neither the workers' start nor the engines'
(about 13 s of a tiny run's 15-25 s on 2 cores).

A run on the stack is what :func:`tiny_grpo.run_grpo` does (:func:`~nemo_rl.algorithms.grpo.
setup`, then :func:`~nemo_rl.algorithms.grpo.grpo_train`) with the stack's clusters, policy and
engines in place of new ones: set-up builds everything else (loaders, environments, logger,
checkpoint manager, loss) from the run's own config, and the run stops only what set-up built
besides the stack. Before each run the stack is put back where a freshly started one is: the
policy loads the checkpoint it saved when the stack started (weights, step count, RNG), its
optimizer starts over (zero Adam state, the configured schedule at step 0), its reference
policy is those weights again, and the engines restart their sampling sequence and their count
of restarts and are refit from the policy before they first generate (a refit of unchanged weights leaves every engine
parameter bitwise as it was: tests/unit/models/generation/test_refit.py). A resumed run then
loads its checkpoint over that, as a fresh one would. A run on a reset stack trains the numbers
of a run on a fresh one, to the bit (loss, grad norm, reward and the engines' logprob error
of every step, with and without a warm start, measured). Importable as ``grpo_stack``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms import grpo, rollout_run
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.components import GRPOComponents, uses_reference_policy
from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.distributed import virtual_cluster
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_bootstrap import shutdown_ray
from nemo_rl.environments.utils import shutdown_environments


def stack_shape(cfg: GRPOMasterConfig) -> dict[str, Any]:
    """What a run's config sets of the workers it starts (runs of equal shapes can share one
    stack); ``data_plane`` is None for the in-memory loop."""
    return {
        "policy": cfg.policy.model_dump(),
        "cluster": cfg.cluster.model_dump(),
        "data_plane": cfg.data_plane.model_dump() if cfg.data_plane.enabled else None,
        "seed": cfg.loop.seed,
        "reference_policy": uses_reference_policy(cfg),
    }


@dataclass
class GRPOStack:
    """A started stack: the ``shape`` it serves, its ``policy``, ``generation`` and
    ``clusters`` (the policy's first), and ``initial``, the policy's checkpoint as started."""

    shape: dict[str, Any]
    policy: Any
    generation: Any
    clusters: list[Any]
    initial: Path

    def mismatches(self, cfg: GRPOMasterConfig) -> list[str]:
        """The parts of ``cfg``'s shape this stack does not serve (none: it serves the run). A
        data-plane stack also serves the in-memory loop (its policy is a ``Policy`` too)."""
        shape = stack_shape(cfg)
        if shape["data_plane"] is None:
            shape["data_plane"] = self.shape["data_plane"]
        return sorted(key for key in shape if shape[key] != self.shape[key])

    def reset(self) -> None:
        """Put the policy and engines back where they were when the stack started."""
        self.policy.load_checkpoint(str(self.initial))
        self.policy.reset_optimizer()
        if self.shape["reference_policy"]:
            self.policy.snapshot_reference_policy()
        self.generation.sampling_step = 0
        # a run counts its own engine restarts (generation/engine_restarts, and the bound
        # policy.generation.max_engine_restarts), as a run on fresh engines does
        self.generation.engine_restarts = [0] * self.generation.num_replicas


def _still_batch(size: int) -> BatchedDataDict:
    """``size`` rows of 8 tokens with the keys :class:`NLLLoss` reads."""
    return BatchedDataDict(
        input_ids=torch.arange(size * 8).reshape(size, 8) % 100 + 1,
        input_lengths=torch.full((size,), 8),
        token_mask=torch.ones(size, 8),
        sample_mask=torch.ones(size),
    )


@contextlib.contextmanager
def start(cfg: GRPOMasterConfig, initial: Path) -> Iterator[GRPOStack]:
    """Start the stack of ``cfg``'s shape (in the running Ray; ``cfg`` without checkpointing),
    saving the started policy's checkpoint to the new folder ``initial``; stop it on exit."""
    components = grpo.setup(cfg)
    try:
        shutdown_environments(components.task_to_env)
        components.task_to_env = {}
        components.logger.close()
        policy = components.policy
        # A checkpoint holds Adam's state, which exists only after a first step: take one at
        # learning rate 0 (the first step of a warm-up from 0), which changes no weight.
        policy.reset_optimizer({"lr_warmup_iters": 1, "lr_decay_iters": 2})
        policy.train(_still_batch(cfg.policy.train_global_batch_size), NLLLoss())
        policy.save_checkpoint(str(initial))
        yield GRPOStack(stack_shape(cfg), policy, components.generation, components.clusters,
                        initial)
    finally:
        rollout_run.shutdown(components)


def setup_on(stack: GRPOStack, cfg: GRPOMasterConfig) -> GRPOComponents:
    """:func:`~nemo_rl.algorithms.grpo.setup` of ``cfg`` with the stack's workers, reset.

    Raises:
        ValueError: ``cfg`` asks for workers of another shape than the stack's.
    """
    differ = stack.mismatches(cfg)
    if differ:
        raise ValueError(f"the run's {differ} differ from the stack's: start a stack of its own")
    stack.reset()
    clusters = iter(stack.clusters)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(virtual_cluster, "RayVirtualCluster", lambda *a, **k: next(clusters))
        patch.setattr(rollout_run, "start_train_and_generation",
                      lambda trained, generation, colocated: ([stack.policy], stack.generation))
        components = grpo.setup(cfg)
    components.generation_stale = True  # the engines hold the last run's weights
    return components


def stop_run(components: GRPOComponents) -> None:
    """Stop what :func:`setup_on` started besides the stack: environments, logger, its Ray
    call."""
    shutdown_environments(components.task_to_env)
    components.logger.close()
    shutdown_ray()


def run_grpo_on(
    stack: GRPOStack,
    cfg: GRPOMasterConfig,
    on_setup: Callable[[GRPOComponents], None] | None = None,
) -> dict[str, float]:
    """:func:`tiny_grpo.run_grpo` of ``cfg`` on the stack: set up (:func:`setup_on`), train,
    then :func:`stop_run`."""
    components = setup_on(stack, cfg)
    try:
        if on_setup is not None:
            on_setup(components)
        return grpo.grpo_train(components)
    finally:
        stop_run(components)


class StackSlot:
    """At most one stack at a time, for runs of several shapes one after another: :meth:`get`
    gives the running stack if it serves the run, else stops it and starts one that does
    (the stacks of two shapes would not fit the local Ray's CPUs together); :meth:`close` stops
    it. ``folder()`` gives a new folder for each stack started."""

    def __init__(self, folder: Callable[[], Path]) -> None:
        self._folder = folder
        self._running = contextlib.ExitStack()
        self._stack: GRPOStack | None = None

    def get(self, cfg: GRPOMasterConfig) -> GRPOStack:
        if self._stack is not None and not self._stack.mismatches(cfg):
            return self._stack
        self.close()
        root = self._folder()
        own = cfg.model_copy(update={
            "logger": cfg.logger.model_copy(update={"log_dir": str(root / "logs")}),
            "checkpointing": cfg.checkpointing.model_copy(update={"enabled": False}),
        })
        self._stack = self._running.enter_context(start(own, root / "initial"))
        return self._stack

    def close(self) -> None:
        self._stack = None
        self._running.close()
