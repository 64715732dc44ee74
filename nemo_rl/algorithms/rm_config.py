"""Typed config of a reward-model run (``nemo-rl rm``): the ``rm`` loop, preference data and the
shared sections. Key names follow NeMo RL's ``examples/configs/rm.yaml``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from nemo_rl.algorithms.dpo_config import PreferenceDataConfig
from nemo_rl.algorithms.loop_config import (
    SupervisedLoopConfig,
    SupervisedMasterConfig,
    check_pairs_stay_whole,
)


class RMConfig(SupervisedLoopConfig):
    """The reward-model loop (``rm``): steps, epochs, validation cadence and size, seed (also
    the seed of the score head's initialisation)."""


class RMMasterConfig(SupervisedMasterConfig):
    """Everything a reward-model run reads; the root of an RM recipe.

    ``policy.reward_model_cfg.enabled`` must be true (the policy gets a scalar head). As in
    NeMo RL, ``policy.train_global_batch_size`` and ``policy.train_micro_batch_size`` count
    preference pairs: the model trains on twice as many rows (chosen and rejected)."""

    LOOP_SECTION: ClassVar[str] = "rm"
    TRAINS_REWARD_MODEL: ClassVar[bool] = True

    rm: RMConfig = Field(default_factory=RMConfig, description="Reward-model loop settings.")
    data: PreferenceDataConfig = Field(
        default_factory=PreferenceDataConfig, description="Preference data."
    )

    @model_validator(mode="after")
    def _check_pairs_stay_whole(self) -> RMMasterConfig:
        check_pairs_stay_whole(self.policy, "RM")
        return self
