"""Supervised fine-tuning: the ``nemo-rl sft`` command and GRPO's SFT warm start.

``nemo-rl sft`` (:func:`run`) trains NLL on the assistant tokens of chat data
(:class:`~nemo_rl.data.conversations.ChatDataset`) in the shared supervised run
(:mod:`nemo_rl.algorithms.supervised`).

GRPO uses :func:`run_sft_steps` as an optional warm start (``sft_warmup`` in the GRPO config): a randomly
initialised or weak model rarely produces a correct answer, so every GRPO group has reward 0
and there is nothing to learn from. A few hundred NLL steps on correct replies get the model
to a partial success rate, from which GRPO's improvement is visible.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from nemo_rl.algorithms import supervised
from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.algorithms.sft_config import SFTMasterConfig
from nemo_rl.algorithms.supervised import SupervisedAlgorithm, sft_train_data
from nemo_rl.data.conversations import ChatDataset
from nemo_rl.data.datasets import Rows, load_rows
from nemo_rl.data.files import check_data_file
from nemo_rl.data.llm_message_utils import rl_collate_fn
from nemo_rl.data.synthetic import SYNTHETIC_ARITHMETIC, synthetic_chat_rows
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
        description="Field of a demonstration holding the reference reply: a text (one "
        "assistant message), or a list of {role, content} messages continuing the "
        "conversation (an agent's exchange: assistant turns with the tool results between "
        "them); only assistant messages are trained.",
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


def load_chat_datasets(cfg: SFTMasterConfig, tokenizer: Any) -> tuple[ChatDataset, ChatDataset | None]:
    """(training set, validation set or None) of an SFT run: ``data.train_path`` /
    ``data.val_path``, or the synthetic task's conversations (training rows from
    ``data.synthetic.seed``, validation rows from ``seed + 1``).

    Raises:
        nemo_rl.data.files.DataError: a line that does not parse, or a row without its
            messages (naming the file, row and ``data.chat_key``).
    """
    data, max_len = cfg.data, cfg.policy.max_total_sequence_length

    def dataset(rows: Rows, source: str) -> ChatDataset:
        return ChatDataset(rows, tokenizer, max_len, data.chat_key, "data.chat_key", source)

    if data.train_path is None:
        syn = data.synthetic
        return (
            dataset(synthetic_chat_rows(syn, syn.num_train, syn.seed, data.chat_key), SYNTHETIC_ARITHMETIC),
            dataset(synthetic_chat_rows(syn, syn.num_val, syn.seed + 1, data.chat_key), SYNTHETIC_ARITHMETIC),
        )
    train = dataset(load_rows(data.train_path), data.train_path)
    val = dataset(load_rows(data.val_path), data.val_path) if data.val_path is not None else None
    return train, val


SFT = SupervisedAlgorithm(
    section="sft",
    loss_fn=NLLLoss(),
    rows_per_sample=1,
    needs_reference=False,
    plot_curves=(("train", "loss"), ("validation", "loss")),
)


def check_run_inputs(cfg: SFTMasterConfig) -> None:
    """``nemo-rl launch slurm``'s checks of the run's data (:func:`supervised.check_inputs`)."""
    supervised.check_inputs(cfg, lambda tok: load_chat_datasets(cfg, tok))


def run(cfg: SFTMasterConfig) -> int | None:
    """``nemo-rl sft``: supervised fine-tuning on chat data (loss on assistant tokens), in the
    shared training loop.

    Returns:
        None when the run finished; 75 when it saved and stopped early.
    """
    return supervised.run_command(
        supervised.setup(cfg, SFT, lambda tok: load_chat_datasets(cfg, tok), rl_collate_fn)
    )
