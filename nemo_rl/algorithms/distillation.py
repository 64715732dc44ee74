"""On-policy distillation: the ``nemo-rl distillation`` command.

The student (``policy``) samples responses with vLLM; a frozen teacher (``teacher``, a second
Megatron policy with the same tokenizer, possibly another size) scores the student's tokens and
sends its top-k per position; the student trains on the KL between the two
(:class:`~nemo_rl.algorithms.loss.DistillationLossFn`). One step (:func:`distillation_step`),
phase by phase, with GRPO's pieces:

1. **generate**: ``num_prompts_per_step`` prompts, ``num_generations_per_prompt`` responses each,
   after the engines took the student's latest weights
   (:func:`~nemo_rl.algorithms.grpo_step.step.rollout_groups`); the environments' rewards are
   only logged (``reward``).
2. **teacher top-k**: ``teacher_topk_logits`` (the teacher's log-probabilities at
   ``loss_fn.temperature``) and ``teacher_topk_indices``, ``[B, S, distillation.topk_logits_k]``.
3. **train**: ``policy.train`` with the KL loss on the response tokens.
4. **refit**: the engines are marked stale; they take the new weights before their next
   generation.

Validation, checkpoints, exact resume and the stop rule are the shared loop's
(:mod:`nemo_rl.algorithms.training_loop`), as for GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_rl.algorithms.distillation_config import DistillationMasterConfig
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.metrics import step_metrics
from nemo_rl.algorithms.grpo_step.step import rollout_groups
from nemo_rl.algorithms.loss import DistillationLossFn
from nemo_rl.algorithms.rollout_command import run_in_memory, start_with_second_model
from nemo_rl.algorithms.rollout_run import RolloutComponents
from nemo_rl.distributed.batched_data_dict import BatchedDataDict


@dataclass
class DistillationComponents(RolloutComponents):
    """Everything a distillation run holds: a rollout-trained run's parts (the student is
    ``policy``) and the frozen ``teacher`` (a :class:`~nemo_rl.models.policy.lm_policy.Policy`)."""

    cfg: DistillationMasterConfig
    loss_fn: DistillationLossFn
    teacher: Any = None


def setup(cfg: DistillationMasterConfig) -> DistillationComponents:
    """The student's run and the frozen teacher's workers on the student's bundles
    (:func:`~nemo_rl.algorithms.rollout_command.start_with_second_model`).

    Raises:
        ConfigError: before anything starts, when the latest checkpoint was trained on another
            model or data than ``cfg`` names.
    """
    parts, teacher = start_with_second_model(cfg, cfg.teacher, "teacher", trained=False)
    return DistillationComponents(
        cfg=cfg, loss_fn=DistillationLossFn(cfg.loss_fn), teacher=teacher, **parts
    )


def add_teacher_topk(components: DistillationComponents, batch: BatchedDataDict) -> BatchedDataDict:
    """``batch`` with the teacher's ``teacher_topk_logits`` and ``teacher_topk_indices``
    ``[B, S, k]`` of its tokens."""
    cfg = components.cfg
    scores = components.teacher.get_topk_logits(
        batch, cfg.distillation.topk_logits_k, cfg.loss_fn.temperature
    )
    out = BatchedDataDict(batch)
    out["teacher_topk_logits"] = scores["topk_logits"]
    out["teacher_topk_indices"] = scores["topk_indices"]
    return out


def distillation_step(
    components: DistillationComponents, store: InMemoryBatchStore, batches: Any
) -> dict[str, float]:
    """One distillation step on the next prompts of ``batches`` (see the module docstring);
    returns its metrics: ``loss``, ``forward_kl``, ``reverse_kl`` (nats per response token),
    ``grad_norm``, ``lr``, ``reward`` (the environments' mean, logged only) and the rollout's
    ``rollout/*`` figures."""
    cfg, timer, policy = components.cfg, components.timer, components.policy
    group_size = cfg.distillation.num_generations_per_prompt
    with store.scope("train", cfg.distillation.num_prompts_per_step * group_size, group_size):
        # generate: the student's rollouts (the environments' rewards are only logged)
        batch, carry = rollout_groups(components, store, next(batches))
        batch = store.add_fields(batch, {"sample_mask": carry.loss_multiplier.float()})

        # teacher top-k on the student's tokens
        with timer.time("teacher_logprobs"):
            batch = add_teacher_topk(components, batch)

        # train the student on the KL to the teacher
        policy.prepare_for_training()
        with timer.time("policy_training"):
            train_results = store.train(batch, components.loss_fn)
        policy.finish_training()

        # refit: the engines take the new weights before their next generation
        components.generation_stale = True
        store.release(batch)
    return step_metrics(carry.metrics, train_results, {})


def run(cfg: DistillationMasterConfig) -> int | None:
    """``nemo-rl distillation``: set up, train in the shared loop
    (:func:`~nemo_rl.algorithms.rollout_command.run_in_memory`), print where logs and
    checkpoints are, stop the teacher and the rest.

    Returns:
        None when the run finished; 75 when it saved and stopped early.
    """
    components = setup(cfg)
    return run_in_memory(
        components,
        lambda store, batches: distillation_step(components, store, batches),
        [components.teacher],
        (("train", "forward_kl"), ("validation", "accuracy")),
    )
