"""Typed config of an on-policy distillation run (``nemo-rl distillation``): the
``distillation`` loop, the KL loss (``loss_fn``), the frozen ``teacher`` policy and the shared
sections of a rollout-trained run. Key names follow NeMo RL's
``examples/configs/distillation_math.yaml``."""

from __future__ import annotations

from pydantic import Field, model_validator

from nemo_rl.algorithms.rollout_config import RolloutLoopConfig, RolloutMasterConfig
from nemo_rl.algorithms.loop_config import check_parallel_layout, shared_vocabulary
from nemo_rl.algorithms.loss.distillation import DistillationLossConfig
from nemo_rl.models.policy.config import PolicyConfig


class DistillationConfig(RolloutLoopConfig):
    """The distillation loop (``distillation``): the rollout loop's keys (the student samples
    ``num_generations_per_prompt`` responses to each of ``num_prompts_per_step`` prompts) and
    the teacher's top-k."""

    topk_logits_k: int = Field(
        default=64,
        ge=1,
        description="Teacher tokens per position sent to the student (values and token ids, "
        "[batch, seq, k] each); at most the vocabulary size.",
    )


class DistillationMasterConfig(RolloutMasterConfig):
    """Everything a distillation run reads; the root of a distillation recipe. ``policy`` is
    the student (trained, sampled with vLLM); ``teacher`` a second Megatron policy, frozen,
    with the student's tokenizer, on the student's bundles."""

    distillation: DistillationConfig = Field(
        default_factory=DistillationConfig, description="Distillation loop settings."
    )
    loss_fn: DistillationLossConfig = Field(
        default_factory=DistillationLossConfig, description="The KL loss (kl_type, top-k handling)."
    )
    teacher: PolicyConfig = Field(
        default_factory=PolicyConfig,
        description="The teacher: model_name, parallel layout, precision, logprob_batch_size "
        "(its scoring micro-batch); its optimizer and generation keys are unused.",
    )

    @property
    def loop(self) -> DistillationConfig:
        """The ``distillation`` section."""
        return self.distillation

    @model_validator(mode="after")
    def _derive_and_check(self) -> DistillationMasterConfig:
        """The shared checks, then what top-k distillation needs of the two models."""
        self.check_rollout_run("distillation", "val_accuracy", "train_loss")
        check_parallel_layout(self.teacher, self.cluster)
        for name, cfg in (("policy", self.policy), ("teacher", self.teacher)):
            if cfg.sequence_packing.enabled or cfg.megatron_cfg.context_parallel_size > 1:
                raise ValueError(
                    f"{name}: top-k distillation scores padded micro-batches without context "
                    f"parallelism; set {name}.sequence_packing.enabled=false and "
                    f"{name}.megatron_cfg.context_parallel_size=1"
                )
        self._check_same_vocabulary()
        return self

    def _check_same_vocabulary(self) -> None:
        """Teacher and student share the tokenizer (the teacher's token ids index the
        student's logits) and ``topk_logits_k`` fits the vocabulary; checked when both models
        are here without a download (otherwise when the run starts)."""
        vocab = shared_vocabulary(
            self.policy.model_name,
            self.teacher.model_name,
            "teacher.model_name",
            "distillation sends the teacher's token ids to the student: use a teacher with the "
            "student's tokenizer",
        )
        if vocab is None:
            return
        k = self.distillation.topk_logits_k
        limit = vocab - 1 if self.loss_fn.zero_outside_topk else vocab
        if k > limit:
            raise ValueError(
                f"distillation.topk_logits_k ({k}) must be <= {limit} (the vocabulary size"
                f"{' - 1: zero_outside_topk keeps a tail outside the top-k' if self.loss_fn.zero_outside_topk else ''}); "
                "lower it"
            )
