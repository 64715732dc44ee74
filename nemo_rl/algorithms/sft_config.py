"""Typed config of an SFT run (``nemo-rl sft``): the ``sft`` loop, chat data and the shared
sections. Key names follow NeMo RL's ``examples/configs/sft.yaml``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from nemo_rl.algorithms.loop_config import (
    SupervisedDataConfig,
    SupervisedLoopConfig,
    SupervisedMasterConfig,
)


class SFTConfig(SupervisedLoopConfig):
    """The SFT loop (``sft``): steps, epochs, validation cadence and size, seed."""


class SFTDataConfig(SupervisedDataConfig):
    """Chat data of an SFT run (``data``): rows with a list of ``{"role", "content"}`` messages;
    the loss covers the assistant messages' tokens only. Without ``train_path``, conversations
    of the synthetic arithmetic task (a question and its correct answer)."""

    chat_key: str = Field(
        default="messages", min_length=1, description="Field of a row holding its messages."
    )


class SFTMasterConfig(SupervisedMasterConfig):
    """Everything an SFT run reads; the root of an SFT recipe."""

    LOOP_SECTION: ClassVar[str] = "sft"

    sft: SFTConfig = Field(default_factory=SFTConfig, description="SFT loop settings.")
    data: SFTDataConfig = Field(default_factory=SFTDataConfig, description="Chat data.")
