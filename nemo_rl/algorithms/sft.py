"""Supervised fine-tuning steps on prompt + reference-reply conversations.

Used by GRPO as an optional warm start (``sft_warmup`` in the GRPO config): a randomly
initialised or weak model rarely produces a correct answer, so every GRPO group has reward 0
and there is nothing to learn from. A few hundred NLL steps on correct replies get the model
to a partial success rate, from which GRPO's improvement is visible.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.data.files import check_data_file
from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.utils.config import ConfigModel


class SFTWarmupConfig(ConfigModel):
    """Supervised warm start before the first GRPO step (``sft_warmup``).

    Runs on a fresh run only (never after resuming from a checkpoint). Each step is one
    optimizer step of the policy on ``global_batch_size`` conversations. The warm start is
    its own training run: its learning rate decays linearly from ``lr`` to ``min_lr`` over
    ``num_steps``, and afterwards the optimizer starts over (zero Adam moments, the policy's
    schedule from step 0), so Adam statistics of supervised gradients do not scale the first
    policy-gradient steps.
    """

    enabled: bool = Field(default=False, description="Run the warm start.")
    num_steps: int = Field(default=100, ge=1, description="Optimizer steps of the warm start.")
    num_samples: int = Field(
        default=1024,
        ge=1,
        description="Distinct warm-start conversations generated (the synthetic task's "
        "training prompts with their correct replies); steps cycle through them. Ignored "
        "with train_path (every demonstration is used).",
    )
    train_path: str | None = Field(
        default=None,
        description="File of demonstrations (.jsonl, .json or .parquet): each row a prompt "
        "(data.prompt_key, rendered like the GRPO prompts) and its reference reply "
        "(response_key). None: the synthetic task's correct replies (needs its rows).",
    )
    response_key: str = Field(
        default="response",
        min_length=1,
        description="Field of a demonstration holding the reference reply.",
    )
    global_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Conversations per warm-up optimizer step. None: "
        "policy.train_global_batch_size.",
    )
    lr: float = Field(default=1e-3, gt=0, description="Learning rate of the first warm-up step.")
    min_lr: float = Field(
        default=1e-4, gt=0, description="Learning rate of the last warm-up step (linear decay)."
    )
    log_period: int = Field(
        default=25, ge=1, description="Print the warm-up loss every this many steps."
    )

    @model_validator(mode="after")
    def _check_lr_range(self) -> SFTWarmupConfig:
        if self.train_path is not None:
            check_data_file(self.train_path, "sft_warmup.train_path")
        if self.min_lr > self.lr:
            raise ValueError(
                f"sft_warmup.min_lr ({self.min_lr}) must be <= sft_warmup.lr ({self.lr})"
            )
        return self

    def lr_schedule(self) -> dict[str, float | int | str]:
        """The warm start's schedule as :meth:`Policy.reset_optimizer` overrides."""
        return {
            "lr": self.lr,
            "min_lr": self.min_lr,
            "lr_decay_style": "linear",
            "lr_warmup_iters": 0,
            "lr_decay_iters": self.num_steps,
        }


def sft_train_data(batch: BatchedDataDict, pad_token_id: int) -> BatchedDataDict:
    """Training data of NLL on the assistant tokens of a collated batch of conversations.

    Args:
        batch: :func:`~nemo_rl.data.llm_message_utils.rl_collate_fn` output (``message_log``,
            ``loss_multiplier`` ``[B]``).
        pad_token_id: fills ``input_ids`` past each row's length.

    Returns:
        ``input_ids`` ``[B, S]``, ``input_lengths`` ``[B]``, ``token_mask`` ``[B, S]`` (1 on
        assistant tokens) and ``sample_mask`` ``[B]`` (0 for truncated rows).
    """
    flat = message_logs_to_flat(batch["message_log"], pad_token_id)
    return BatchedDataDict(
        input_ids=flat["input_ids"],
        input_lengths=flat["input_lengths"],
        token_mask=flat["token_mask"].float(),
        sample_mask=batch["loss_multiplier"].float(),
    )


def run_sft_steps(
    policy: Any,
    loader: Any,
    num_steps: int,
    pad_token_id: int,
    log_period: int,
    global_batch_size: int | None = None,
) -> list[float]:
    """``num_steps`` NLL optimizer steps of ``policy`` on batches from ``loader``.

    Args:
        policy: a :class:`~nemo_rl.models.policy.lm_policy.Policy` (or anything with its
            ``prepare_for_training`` / ``train`` / ``finish_training``).
        loader: an iterator of collated conversation batches of ``global_batch_size`` rows.
        num_steps: optimizer steps.
        pad_token_id: padding id of the flattened rows.
        log_period: print the loss every this many steps.
        global_batch_size: rows per optimizer step; None: the policy's
            ``train_global_batch_size``.

    Returns:
        The loss of every step (per valid token, nats).
    """
    loss_fn = NLLLoss()
    batches = iter(loader)
    losses: list[float] = []
    policy.prepare_for_training()
    for step in range(1, num_steps + 1):
        data = sft_train_data(next(batches), pad_token_id)
        results = policy.train(data, loss_fn, gbs=global_batch_size)
        losses.append(float(results["loss"][-1]))
        if step % log_period == 0 or step == num_steps:
            print(f"sft warm-up step {step}/{num_steps}: loss {losses[-1]:.4f}", flush=True)
    policy.finish_training()
    return losses
