"""Typed config of a reward-model run (``nemo-rl rm``): the ``rm`` loop, preference data and the
shared sections. Key names follow NeMo RL's ``examples/configs/rm.yaml``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from nemo_rl.algorithms.dpo_config import PreferenceMasterConfig
from nemo_rl.algorithms.loop_config import SupervisedLoopConfig


class RMConfig(SupervisedLoopConfig):
    """The reward-model loop (``rm``): steps, epochs, validation cadence and size, seed (also
    the seed of the score head's initialisation)."""


class RMMasterConfig(PreferenceMasterConfig):
    """Everything a reward-model run reads; the root of an RM recipe.

    ``policy.reward_model_cfg.enabled`` must be true (the policy gets a scalar head); batch
    sizes count pairs, as in DPO."""

    LOOP_SECTION: ClassVar[str] = "rm"
    TRAINS_REWARD_MODEL: ClassVar[bool] = True

    rm: RMConfig = Field(default_factory=RMConfig, description="Reward-model loop settings.")
