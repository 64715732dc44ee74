"""A single-turn environment whose reward is a trained reward model's score.

The reward model is an HF sequence-classification folder with one label (what ``nemo-rl rm``
trains and ``nemo-rl export`` writes: ``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``...), loaded with transformers on the CPU of the
environment's Ray actor. A conversation is scored as the reward model was trained: each
message's text (as the policy saw it, chat template included) tokenized with the reward
model's tokenizer and concatenated; the score is the model's output at the last token. Every
episode ends after one turn.

A GRPO recipe uses it as a plug-in environment::

    env:
      my_task:
        cls: nemo_rl.environments.reward_model_environment:RewardModelEnvironment
        model_path: results/rm_hf        # the exported reward model
        processor: prompt                # rows need only a prompt
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.families import SEQUENCE_CLASSIFIER_SUFFIX
from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.data.templates import tokenize_text
from nemo_rl.environments.common import final_step_return
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn


def check_reward_model_folder(model_path: str, where: str) -> None:
    """``model_path`` is an HF sequence classifier with one label and a ``pad_token_id``.

    Raises:
        ValueError: naming ``where`` (the recipe field) and what is wrong.
    """
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{where}={model_path!r} has no config.json; export the reward model with "
            "`nemo-rl export CHECKPOINT OUT` and name OUT"
        )
    config = json.loads(config_file.read_text())
    arch = (config.get("architectures") or ["a model without architectures"])[0]
    labels = len(config.get("id2label") or {"0": ""})
    if not arch.endswith(SEQUENCE_CLASSIFIER_SUFFIX) or labels != 1:
        found = f"{labels} labels" if arch.endswith(SEQUENCE_CLASSIFIER_SUFFIX) else arch
        raise ValueError(
            f"{where}={model_path!r} is not a reward model ({found}): expected a "
            f"...{SEQUENCE_CLASSIFIER_SUFFIX} with one label, as `nemo-rl rm` trains and "
            "`nemo-rl export` writes"
        )
    if config.get("pad_token_id") is None:
        raise ValueError(
            f"{where}={model_path!r}: config.json has no pad_token_id (transformers needs it to "
            "find each sequence's last token); set it"
        )


class RewardModelEnvironment(EnvironmentInterface):
    """Scores each conversation with a reward model; usable in-process or as a Ray actor.

    Args:
        model_path: the reward model's HF folder.
        batch_size: conversations per forward pass.
    """

    default_processor = "prompt"

    def __init__(self, model_path: str, batch_size: int = 16) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model_folder(model_path, "model_path")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, torch_dtype=torch.float32
        ).eval()
        self.pad_token_id = int(self.model.config.pad_token_id)
        self.batch_size = batch_size

    @classmethod
    def check_arguments(cls, where: str, *args: Any, **kwargs: Any) -> None:
        """The folder is a one-label HF sequence classifier with a pad token (``where``: the
        section's ``cls`` field; the error names its ``model_path``)."""
        section = where.removesuffix(".cls")
        check_reward_model_folder(kwargs["model_path"], f"{section}.model_path")

    def token_ids(self, log: LLMMessageLogType) -> torch.Tensor:
        """``[n]`` token ids of a conversation: each message's text tokenized, concatenated."""
        return torch.cat([tokenize_text(self.tokenizer, m["content"]) for m in log])

    @torch.no_grad()
    def scores(self, logs: list[LLMMessageLogType]) -> torch.Tensor:
        """``[B]`` float32 reward-model scores of the conversations."""
        out = []
        for start in range(0, len(logs), self.batch_size):
            rows = [self.token_ids(log) for log in logs[start : start + self.batch_size]]
            ids = torch.nn.utils.rnn.pad_sequence(
                rows, batch_first=True, padding_value=self.pad_token_id
            )
            mask = torch.zeros_like(ids)
            for i, row in enumerate(rows):
                mask[i, : row.numel()] = 1
            out.append(self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
        return torch.cat(out) if out else torch.zeros(0)

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """The reward model's score of each conversation; every episode ends."""
        return final_step_return(self.scores(message_log_batch))

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """No task metric beyond the reward itself; batch unchanged."""
        return batch, {}
