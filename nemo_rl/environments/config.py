"""Typed config of the environments (the ``env`` section): one optional section per task.

``env.math`` follows NeMo RL's keys (``num_workers``, ``stop_strings``). A section left at
None starts no environment; :func:`nemo_rl.environments.utils.create_environments` starts one
Ray actor per configured section, keyed by the section's name (the samples' ``task_name``).
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from nemo_rl.utils.config import ConfigModel


class EnvActorConfig(ConfigModel):
    """What every environment actor reserves from Ray."""

    num_cpus: float = Field(
        default=0.25,
        gt=0,
        description="Logical Ray CPUs the environment's actor reserves (fractions allowed; "
        "environments are light, so several share a core).",
    )


class MathEnvConfig(EnvActorConfig):
    """``env.math``: single-turn answers checked with math-verify."""

    num_workers: int = Field(
        default=1,
        ge=1,
        description="Processes that verify a step's responses in parallel; 1 verifies "
        "in the actor's own process.",
    )
    stop_strings: Optional[list[str]] = Field(
        default=None, description="Stop strings for the next turn (None: none)."
    )
    verify_timeout_s: int = Field(
        default=5,
        ge=0,
        description="Seconds math-verify may spend parsing or comparing one answer before it "
        "counts as wrong; 0 disables the limit.",
    )


class NumberGuessEnvConfig(EnvActorConfig):
    """``env.number_guess``: guess the secret number, told "higher" or "lower" each turn."""

    max_turns: int = Field(
        default=6, ge=1, description="Guesses allowed before the episode ends unsolved."
    )
    turn_penalty: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Reward lost per extra guess: solving on guess t earns "
        "max(0, 1 - turn_penalty * (t - 1)).",
    )


class CalculatorEnvConfig(EnvActorConfig):
    """``env.calculator``: the model may compute ``<calc>expr</calc>`` before answering."""

    max_turns: int = Field(
        default=4,
        ge=1,
        description="Assistant turns allowed (calculator calls plus the final answer).",
    )
    timeout_s: float = Field(
        default=1.0, gt=0, description="Seconds one expression may take to evaluate."
    )
    max_expression_chars: int = Field(
        default=200, ge=1, description="Longest expression evaluated; longer ones are refused."
    )
    max_exponent: int = Field(
        default=64, ge=1, description="Largest absolute exponent allowed in ``a ** b``."
    )
    max_result_digits: int = Field(
        default=100,
        ge=1,
        description="Largest number of decimal digits of any intermediate integer result.",
    )
    verify_timeout_s: int = Field(
        default=5,
        ge=0,
        description="Seconds math-verify may spend on the final answer; 0 disables the limit.",
    )


class EnvConfigs(ConfigModel):
    """``env``: the environments of a run, by task name; None leaves a task out."""

    math: Optional[MathEnvConfig] = Field(
        default_factory=MathEnvConfig, description="Math answers (task_name 'math')."
    )
    number_guess: Optional[NumberGuessEnvConfig] = Field(
        default=None, description="Number guessing game (task_name 'number_guess')."
    )
    calculator: Optional[CalculatorEnvConfig] = Field(
        default=None, description="Calculator tool use (task_name 'calculator')."
    )

    @property
    def total_cpus(self) -> float:
        """Logical Ray CPUs all configured environment actors reserve together."""
        sections = (self.math, self.number_guess, self.calculator)
        return sum(section.num_cpus for section in sections if section is not None)
