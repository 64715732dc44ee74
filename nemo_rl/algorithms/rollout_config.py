"""Typed config shared by the algorithms that train on the policy's own rollouts (GRPO,
distillation): their loop keys, the prompt data, and the sections of the master config every
such recipe has (:class:`RolloutMasterConfig`) with the checks spanning them.

The defaults describe a tiny CPU run (8 prompts x 4 generations on a tiny model); recipes in
``configs/`` state only what they choose. Key names follow NeMo RL's.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from nemo_rl.algorithms.loop_config import (
    ClusterConfig,
    check_checkpoint_metric,
    check_generation_layout,
    check_parallel_layout,
    check_reward_head,
    derive_lr_decay_iters,
)
from nemo_rl.data.config import SyntheticArithmeticConfig
from nemo_rl.data.files import FILE_READERS, check_data_file
from nemo_rl.data.synthetic import SYNTHETIC_ARITHMETIC, SYNTHETIC_TASK_NAME
from nemo_rl.environments.config import EnvConfigs
from nemo_rl.models.generation.placement import TP_FIELD
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.utils.checkpoint import CheckpointingConfig
from nemo_rl.utils.config import ConfigModel
from nemo_rl.utils.logger import LoggerConfig


class RolloutLoopConfig(ConfigModel):
    """Loop keys of the algorithms that train on the policy's own rollouts (``grpo``,
    ``distillation``): rollout sizes, validation cadence, seed (NeMo RL's names)."""

    num_prompts_per_step: int = Field(default=8, ge=1, description="Prompts sampled per step.")
    num_generations_per_prompt: int = Field(
        default=4, ge=1, description="Responses generated per prompt (a group)."
    )
    max_num_steps: int = Field(default=10, ge=1, description="Training steps of the run.")
    max_rollout_turns: int = Field(
        default=1,
        ge=1,
        description="Generate/environment round trips per rollout; 1 is single-turn.",
    )
    val_period: int = Field(
        default=0, ge=0, description="Validate every this many steps; 0 disables."
    )
    val_at_start: bool = Field(default=False, description="Validate once before the first step.")
    max_val_samples: int = Field(
        default=16, ge=1, description="Validation prompts evaluated per validation."
    )
    val_batch_size: int = Field(default=8, ge=1, description="Prompts per validation batch.")
    val_greedy: bool = Field(
        default=False,
        description="Validate with argmax decoding. False: sample with the generation config "
        "(temperature, top_p, top_k), as in training, so the validation reward estimates the "
        "expected reward of the policy's samples.",
    )
    seed: int = Field(default=42, description="Seed of data order, sampling and initialisation.")

    @property
    def prompts_per_generation_batch(self) -> int:
        """Prompts the data loader yields per generation batch."""
        return self.num_prompts_per_step

    @property
    def validates(self) -> bool:
        """Whether the run validates at all."""
        return self.val_period > 0 or self.val_at_start


class DatasetSourceConfig(ConfigModel):
    """One dataset of ``data.train_datasets``, mixed with the others by weight."""

    path: str = Field(
        min_length=1,
        description="Local file (.jsonl, .json or .parquet), or an HF datasets name / local "
        "dataset folder.",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        description="Share of the mixture: an epoch of the mixture has as many rows as all "
        "datasets together, weight / sum(weights) of them drawn from this one (its rows "
        "repeated or subsampled, in a seeded order).",
    )
    split: str = Field(default="train", description="HF split (ignored for a local file).")
    subset: str | None = Field(default=None, description="HF config (subset) name. None: none.")
    prompt_key: str | None = Field(
        default=None, description="Field holding the prompt. None: data.prompt_key."
    )
    answer_key: str | None = Field(
        default=None, description="Field holding the answer. None: data.answer_key."
    )
    task_name: str | None = Field(
        default=None,
        description="Task of this dataset's rows without a task_name field of their own. None: "
        "data.task_name.",
    )

    @model_validator(mode="after")
    def _check_local_file(self) -> DatasetSourceConfig:
        path = Path(self.path)
        if path.suffix.lower() in FILE_READERS or path.is_file():
            check_data_file(self.path, "data.train_datasets[].path")
        return self


class DataConfig(ConfigModel):
    """Prompt data (``data``); built by :func:`nemo_rl.data.datasets.setup_datasets`."""

    dataset_name: str = Field(
        default="synthetic_arithmetic",
        min_length=1,
        description='Dataset to train on: "synthetic_arithmetic" (built in, see data.synthetic), '
        "or an HF datasets name / local dataset folder for the splits without a "
        "train_path/val_path.",
    )
    dataset_subset: str | None = Field(
        default=None, description="HF datasets config (subset) name of dataset_name. None: none."
    )
    train_path: str | None = Field(
        default=None,
        description="Local training file (.jsonl, .json or .parquet), read whatever "
        "dataset_name says. None: dataset_name's train_split.",
    )
    val_path: str | None = Field(
        default=None,
        description="Local validation file (.jsonl, .json or .parquet), read whatever "
        "dataset_name says. None: dataset_name's val_split (the synthetic task's own validation "
        "set when it also gives the training rows).",
    )
    train_datasets: list[DatasetSourceConfig] = Field(
        default_factory=list,
        description="Several training datasets mixed by weight (each with its own keys and "
        "task); replaces train_path and dataset_name's training split. Empty: not used.",
    )
    train_split: str = Field(default="train", description="HF split used for training.")
    val_split: str | None = Field(
        default=None, description="HF split used for validation. None: no validation set "
        "unless val_path is set (the synthetic task always has one)."
    )
    prompt_key: str = Field(
        default="prompt",
        min_length=1,
        description="Field of a record holding the prompt: a text, or a list of "
        '{"role", "content"} messages (chat format, e.g. prompt_key: messages).',
    )
    answer_key: str | None = Field(
        default="answer",
        description="Field of a record holding the ground-truth answer. Another name than "
        "'answer' must be a field of every row (a null value: that row has no answer); the "
        "default may be absent (rows without answers). None: no answers.",
    )
    task_name: str | None = Field(
        default=None,
        description="Task (an env section's name: its environment and data processor) of rows "
        'without a task_name field of their own. None: "math".',
    )
    prompt_file: str | None = Field(
        default=None,
        description="File holding a prompt template with a {} placeholder for the prompt text. "
        "None: the prompt as is (the synthetic task adds an answer-format instruction).",
    )
    system_prompt_file: str | None = Field(
        default=None, description="File holding the system prompt. None: no system message."
    )
    shuffle: bool = Field(
        default=True, description="Shuffle the training prompts every epoch (seeded by grpo.seed)."
    )
    synthetic: SyntheticArithmeticConfig = Field(
        default_factory=SyntheticArithmeticConfig,
        description="The built-in synthetic_arithmetic task (used when dataset_name is it).",
    )
    max_input_seq_length: int | None = Field(
        default=None,
        ge=1,
        description="Prompts longer than this many tokens are truncated to it and kept out of "
        "the loss (loss_multiplier 0). None: policy.max_total_sequence_length.",
    )

    @property
    def uses_synthetic(self) -> bool:
        """Whether the training rows are the built-in synthetic task's."""
        return (
            self.dataset_name == SYNTHETIC_ARITHMETIC
            and self.train_path is None
            and not self.train_datasets
        )

    @model_validator(mode="after")
    def _check_files(self) -> DataConfig:
        """train_path / val_path exist and have a supported suffix."""
        for name in ("train_path", "val_path"):
            path = getattr(self, name)
            if path is not None:
                check_data_file(path, f"data.{name}")
        if self.train_datasets and self.train_path is not None:
            raise ValueError(
                "data.train_datasets and data.train_path both name the training data; set one "
                "(add train_path's file to train_datasets as {path: ..., weight: ...})"
            )
        return self


class RolloutMasterConfig(ConfigModel):
    """Sections of every recipe that trains on the policy's rollouts (GRPO, distillation): the
    policy, its prompts and environments, machines, logging, checkpoints; a subclass adds its
    loop section (:attr:`loop`) and loss."""

    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="The trained policy.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    env: EnvConfigs = Field(
        default_factory=EnvConfigs, description="Environments, by task name."
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Machines.")
    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Metric logging.")
    checkpointing: CheckpointingConfig = Field(
        default_factory=CheckpointingConfig, description="Checkpointing."
    )

    @property
    def loop(self) -> RolloutLoopConfig:
        """The algorithm's loop section."""
        raise NotImplementedError

    def check_rollout_run(self, section: str, val_example: str, train_example: str) -> int:
        """Checks spanning the shared sections and the loop section ``section``; fills
        ``data.max_input_seq_length`` and the learning-rate horizon; returns the optimizer
        steps per training step.

        Args:
            val_example, train_example: a validation and a train metric of the algorithm, for
                the message of a bad ``checkpointing.metric_name``.
        """
        loop = self.loop
        samples = loop.num_prompts_per_step * loop.num_generations_per_prompt
        if samples % self.policy.train_global_batch_size:
            raise ValueError(
                f"{section}.num_prompts_per_step * {section}.num_generations_per_prompt "
                f"({samples}) must be a multiple of policy.train_global_batch_size "
                f"({self.policy.train_global_batch_size})"
            )
        if self.data.max_input_seq_length is None:
            self.data.max_input_seq_length = self.policy.max_total_sequence_length
        elif self.data.max_input_seq_length > self.policy.max_total_sequence_length:
            raise ValueError(
                f"data.max_input_seq_length ({self.data.max_input_seq_length}) must be <= "
                f"policy.max_total_sequence_length ({self.policy.max_total_sequence_length})"
            )
        check_parallel_layout(self.policy, self.cluster)
        check_generation_layout(
            self.policy.generation.vllm_cfg.tensor_parallel_size, self.cluster, TP_FIELD
        )
        check_reward_head(self.policy, section, trains_reward_model=False)
        self._check_task()
        self._check_agents()
        check_checkpoint_metric(
            self.checkpointing, loop.validates, section, (val_example, train_example)
        )
        steps = samples // self.policy.train_global_batch_size
        derive_lr_decay_iters(
            self.policy, loop.max_num_steps * steps, f"{section}.max_num_steps"
        )
        return steps

    def _check_agents(self) -> None:
        """Agent plug-ins and the engines' HTTP endpoint go together: with the endpoint every
        sample is rolled out by its task's agent (nemo_rl.experience.agent_rollouts)."""
        agents = self.env.agent_tasks()
        serving = self.policy.generation.vllm_cfg.expose_http_server
        if agents and not serving:
            raise ValueError(
                f"env.{agents[0]}.agent_fn runs its episodes against the engines' HTTP endpoint: "
                "set policy.generation.vllm_cfg.expose_http_server=true"
            )
        others = sorted(set(self.env.sections()) - set(agents))
        if serving and others:
            raise ValueError(
                "policy.generation.vllm_cfg.expose_http_server=true rolls every sample out "
                f"through an agent plug-in (env.<task>.agent_fn), but env.{others[0]} is not "
                f"one (configured without an agent: {others}); set it to null, or give it an "
                "agent_fn"
            )

    def _check_task(self) -> None:
        """The rows' default task names a configured environment (whose processor resolved
        when ``env`` was validated); rows' own task names are checked when the data loads."""
        for field, task in train_tasks(self.data).items():
            self.env.check_task(task, field)


def train_tasks(data: DataConfig) -> dict[str, str]:
    """``{recipe field: task name}`` of the training rows' tasks known at config time
    (``data.task_name``, else the synthetic task, and each train dataset's own)."""
    tasks = {"data.task_name": data.task_name or SYNTHETIC_TASK_NAME}
    for i, source in enumerate(data.train_datasets):
        if source.task_name is not None:
            tasks[f"data.train_datasets[{i}].task_name"] = source.task_name
    return tasks
