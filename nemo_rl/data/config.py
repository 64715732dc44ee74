"""Typed config of the built-in synthetic arithmetic task (``data.synthetic``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nemo_rl.utils.config import ConfigModel

Operator = Literal["+", "-", "*"]


class SyntheticArithmeticConfig(ConfigModel):
    """Seeded arithmetic problems such as "What is 3 + 4?": the default task, needs no download.

    The defaults (single-digit addition of two terms) are learnable by a tiny model on CPU.
    """

    num_train: int = Field(default=1024, ge=1, description="Training problems generated.")
    num_val: int = Field(default=64, ge=1, description="Validation problems generated.")
    min_operand: int = Field(default=0, ge=0, description="Smallest operand (inclusive).")
    max_operand: int = Field(default=9, ge=0, description="Largest operand (inclusive).")
    operators: list[Operator] = Field(
        default_factory=lambda: ["+"],
        min_length=1,
        description='Operators drawn uniformly per position, from "+", "-", "*".',
    )
    num_terms: int = Field(default=2, ge=2, description="Operands per problem.")
    answer_format: Literal["boxed", "plain"] = Field(
        default="boxed",
        description='How a correct response states the answer: "boxed" is "\\boxed{7}", '
        '"plain" is "7". Used by the SFT warm-start set and the default prompt instruction.',
    )
    seed: int = Field(
        default=1234,
        description="Seed of the generator; the validation set uses seed + 1 (sets may share "
        "problems when the problem space is small).",
    )

    @model_validator(mode="after")
    def _check_range(self) -> SyntheticArithmeticConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"data.synthetic.min_operand ({self.min_operand}) must be <= "
                f"data.synthetic.max_operand ({self.max_operand})"
            )
        return self
