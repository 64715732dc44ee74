"""Typed config of ``nemo-rl eval`` (the root of an eval recipe). Key names follow NeMo RL's
eval recipes (``eval.metric``, ``eval.num_tests_per_prompt``, ``eval.k_value``, ``eval.seed``,
``eval.save_path``, ``generation.model_name``); the ``data``, ``env`` and ``cluster`` sections are
GRPO's, and the prompts evaluated are the data's validation split."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import Field, model_validator

from nemo_rl.algorithms.loop_config import ClusterConfig, check_generation_layout
from nemo_rl.algorithms.rollout_config import DataConfig, RolloutMasterConfig
from nemo_rl.data.synthetic import SYNTHETIC_TASK_NAME
from nemo_rl.environments.config import EnvConfigs
from nemo_rl.environments.registry import EnvironmentSpec
from nemo_rl.models.generation.config import GenerationConfig
from nemo_rl.utils.config import ConfigError, ConfigModel


def check_tasks_return_answers(
    metric: str, tasks: Iterable[str], specs: Mapping[str, EnvironmentSpec]
) -> None:
    """maj@k (``metric``) votes over the answers the environments extract: each of ``tasks``
    must have an environment that returns them.

    Raises:
        ConfigError: naming the first task without, and what to set.
    """
    for task in dict.fromkeys(tasks):
        if not specs[task].returns_answers:
            raise ConfigError(
                f"eval.metric={metric} votes over the answers a task's environment extracts, "
                f"but task {task!r} (env.{task}) returns none: give its reward_fn an answer_fn "
                "('package.module:function', fn(prompt, response, answer, metadata) -> str or "
                "None), set returns_answers = True on its environment class if its step() "
                "returns answers, or use eval.metric=pass@k"
            )


class EvalConfig(ConfigModel):
    """What is measured (``eval``)."""

    metric: Literal["pass@k", "maj@k", "cons@k"] = Field(
        default="pass@k",
        description="The headline score of the summary (all are computed and saved): pass@k, "
        "or maj@k (also called cons@k): majority vote over the answers the environment "
        "extracts from k samples (refused for a task whose environment returns none; maj@k is "
        "then left out of the summary).",
    )
    num_tests_per_prompt: int = Field(
        default=1, ge=1, description="Samples generated per prompt (n of the pass@k estimator)."
    )
    k_value: int = Field(default=1, ge=1, description="k of pass@k and maj@k; <= "
                         "num_tests_per_prompt.")
    pass_threshold: float = Field(
        default=1.0, description="A sample passes when its reward is at least this."
    )
    seed: int = Field(default=42, description="Base of the engines' per-request sampling seeds.")
    num_prompts_per_step: int = Field(
        default=-1,
        description="Prompts per generation call (NeMo RL has it under generation); -1: all at "
        "once. Match grpo.val_batch_size to reproduce a training run's validation batches.",
    )
    max_num_prompts: int | None = Field(
        default=None, ge=1, description="Evaluate the first this many prompts. None: all."
    )
    max_rollout_turns: int = Field(
        default=1, ge=1, description="Generate/environment round trips per sample."
    )
    save_path: str | None = Field(
        default=None,
        description="Folder for samples.jsonl (every prompt, response, answer and reward), "
        "summary.json and config.yaml. None: print the summary only.",
    )

    @property
    def votes(self) -> bool:
        """Whether the headline is maj@k (cons@k)."""
        return self.metric != "pass@k"

    @model_validator(mode="after")
    def _check_k(self) -> EvalConfig:
        if self.k_value > self.num_tests_per_prompt:
            raise ValueError(
                f"eval.k_value ({self.k_value}) exceeds eval.num_tests_per_prompt "
                f"({self.num_tests_per_prompt}): pass@k draws k of the n samples; raise "
                "num_tests_per_prompt or lower k_value"
            )
        if self.num_prompts_per_step == 0 or self.num_prompts_per_step < -1:
            raise ValueError(
                f"eval.num_prompts_per_step={self.num_prompts_per_step}: use -1 (all prompts "
                "at once) or a positive count"
            )
        return self


class EvalGenerationConfig(GenerationConfig):
    """The engines (``generation``): GRPO's generation settings plus the model."""

    model_name: str = Field(
        default="tiny-llama",
        min_length=1,
        description="What to evaluate: a hub model name, an HF folder, a built-in tiny model, "
        "or a training checkpoint (a checkpoint_dir, its latest step is used; a step_<n> "
        "folder; a policy folder), exported to HF first (nemo-rl export).",
    )


class EvalMasterConfig(ConfigModel):
    """Everything ``nemo-rl eval`` reads."""

    eval: EvalConfig = Field(default_factory=EvalConfig, description="What is measured.")
    generation: EvalGenerationConfig = Field(
        default_factory=EvalGenerationConfig, description="Model and engines."
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="Prompt data; its validation split is evaluated."
    )
    env: EnvConfigs = Field(default_factory=EnvConfigs, description="Judges, by task name.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Machines.")

    @model_validator(mode="after")
    def _derive_and_check(self) -> EvalMasterConfig:
        """Prompt length from the engines' context; the task must have a processor and an
        environment (the same check as a GRPO recipe's)."""
        max_len = self.generation.vllm_cfg.max_model_len
        if max_len is None:
            raise ValueError(
                "generation.vllm_cfg.max_model_len is unset; set it (prompts and responses of "
                "an evaluation must fit in it)"
            )
        if self.data.max_input_seq_length is None:
            self.data.max_input_seq_length = max_len
        RolloutMasterConfig._check_task(self)  # type: ignore[arg-type]  # reads .data and .env
        if self.eval.votes:  # the rows' own task names are checked when the data loads
            task = self.data.task_name or SYNTHETIC_TASK_NAME
            check_tasks_return_answers(self.eval.metric, [task], self.env.specs())
        check_generation_layout(
            self.generation.vllm_cfg.tensor_parallel_size,
            self.cluster,
            "generation.vllm_cfg.tensor_parallel_size",
        )
        return self
