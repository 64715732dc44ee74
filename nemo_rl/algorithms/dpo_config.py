"""Typed config of a DPO run (``nemo-rl dpo``): the ``dpo`` loop and loss, preference data and the
shared sections. Key names follow NeMo RL's ``examples/configs/dpo.yaml``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from nemo_rl.algorithms.loop_config import (
    SupervisedDataConfig,
    SupervisedLoopConfig,
    SupervisedMasterConfig,
)
from nemo_rl.algorithms.loss.dpo import DPOLossConfig


class DPOConfig(DPOLossConfig, SupervisedLoopConfig):
    """The DPO loop and loss (``dpo``): the loop keys of SFT plus the loss's
    (``reference_policy_kl_penalty``, ``preference_average_log_probs``,
    ``sft_average_log_probs``, ``preference_loss_weight``, ``sft_loss_weight``)."""


class PreferenceDataConfig(SupervisedDataConfig):
    """Preference data of a DPO or reward-model run (``data``): rows ``{prompt, chosen, rejected}`` (a text or a
    list of messages each) or NeMo RL's ``{context, completions}``. Without ``train_path``,
    questions of the synthetic arithmetic task with a correct (chosen) and a wrong (rejected)
    answer."""

    prompt_key: str = Field(default="prompt", min_length=1, description="Field of the prompt.")
    chosen_key: str = Field(
        default="chosen", min_length=1, description="Field of the preferred reply."
    )
    rejected_key: str = Field(
        default="rejected", min_length=1, description="Field of the dispreferred reply."
    )

    @property
    def keys(self) -> tuple[str, str, str]:
        """(prompt, chosen, rejected) field names."""
        return self.prompt_key, self.chosen_key, self.rejected_key


class PreferenceMasterConfig(SupervisedMasterConfig):
    """A recipe trained on preference pairs (DPO, RM): its ``data`` and the check that pairs
    stay whole.

    As in NeMo RL, ``policy.train_global_batch_size`` and ``policy.train_micro_batch_size``
    count preference pairs: the policy trains on twice as many rows (chosen and rejected)."""

    data: PreferenceDataConfig = Field(
        default_factory=PreferenceDataConfig, description="Preference data."
    )

    @model_validator(mode="after")
    def _check_pairs_stay_whole(self) -> PreferenceMasterConfig:
        """Token-budgeted micro-batches would split or reorder the (chosen, rejected) rows."""
        for key in ("dynamic_batching", "sequence_packing"):
            if getattr(self.policy, key).enabled:
                raise ValueError(
                    f"policy.{key}.enabled is not supported by {self.LOOP_SECTION.upper()} (its "
                    "micro-batches would separate a pair's chosen and rejected rows); set it to "
                    "false"
                )
        return self


class DPOMasterConfig(PreferenceMasterConfig):
    """Everything a DPO run reads; the root of a DPO recipe."""

    LOOP_SECTION: ClassVar[str] = "dpo"

    dpo: DPOConfig = Field(default_factory=DPOConfig, description="DPO loop and loss settings.")
