"""Config pieces every training algorithm shares: the cluster section, the checks of the parallel
layout, the learning-rate horizon and the checkpoint metric, and the loop and data sections of the
supervised algorithms (SFT, DPO, RM) with NeMo RL's key names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from nemo_rl.data.config import SyntheticArithmeticConfig
from nemo_rl.data.files import check_data_file
from nemo_rl.distributed.memory_plan import MemoryPlan, NoMemoryPlan
from nemo_rl.models.generation.placement import GenerationLayout, plan_generation_layout
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.gpu_memory import plan_policy_memory
from nemo_rl.models.policy.parallel_layout import ParallelLayout, plan_parallel_layout
from nemo_rl.models.model_path import local_model_path
from nemo_rl.utils.checkpoint import CheckpointingConfig
from nemo_rl.utils.config import ConfigModel
from nemo_rl.utils.logger import LoggerConfig


class ClusterConfig(ConfigModel):
    """Machines of the run (``cluster``)."""

    num_nodes: int = Field(default=1, ge=1, description="Machines in the Ray cluster.")
    gpus_per_node: int = Field(
        default=0, ge=0, description="GPUs used on each machine; 0 runs everything on CPU."
    )
    cpus_per_node: int = Field(
        default=8,
        ge=1,
        description="Logical CPUs each machine offers Ray for scheduling actors (may exceed "
        "the physical cores; actors take fractions of them).",
    )
    cpu_bundles_per_node: int = Field(
        default=1,
        ge=1,
        description="CPU runs (gpus_per_node 0): worker slots per machine; each policy rank "
        "and each generation engine takes one. Ignored when gpus_per_node > 0 (one per GPU).",
    )
    gpu_memory_gb: float = Field(
        default=80.0,
        gt=0.0,
        description="Memory of one GPU, GiB (80 for an H100 80GB, about 140 for an H200). "
        "The recipe's GPU memory plan (printed by --print-config and `nemo-rl launch slurm`) "
        "must fit in it: a recipe whose plan needs more in some phase is refused, naming the "
        "largest term. Ignored on CPU (gpus_per_node 0).",
    )

    @property
    def slots_per_node(self) -> tuple[int, str]:
        """(worker slots, i.e. bundles, per node; the field that gives them)."""
        if self.gpus_per_node:
            return self.gpus_per_node, "cluster.gpus_per_node"
        return self.cpu_bundles_per_node, "cluster.cpu_bundles_per_node"

    @property
    def ranks(self) -> tuple[int, str]:
        """(policy ranks the cluster holds, where that number comes from)."""
        slots, name = self.slots_per_node
        return self.num_nodes * slots, f"cluster.num_nodes x {name} = {self.num_nodes} x {slots}"


def check_parallel_layout(policy: PolicyConfig, cluster: ClusterConfig) -> ParallelLayout:
    """TP x PP x CP x DP against the ranks the cluster section gives (GPUs, or CPU worker
    slots), and against the model's heads, KV heads and layers when its config.json is here
    without a download (a hub model not yet cached is checked when the run starts); returns
    the layout."""
    world, source = cluster.ranks
    return plan_parallel_layout(
        policy, local_model_path(policy.model_name), world, world_source=source
    )


def shared_vocabulary(policy_model: str, other_model: str, field: str, why: str) -> int | None:
    """The vocabulary size the policy's model and a second model (a distillation teacher, a PPO
    critic) share, both named as ``model_name`` values; None when one of them is not here
    without a download (checked when the run starts).

    Raises:
        ValueError: their tokenizers or vocabulary sizes differ; names ``field`` (where
            ``other_model`` comes from) and says ``why`` they must agree.
    """
    policy, other = local_model_path(policy_model), local_model_path(other_model)
    if policy is None or other is None:
        return None
    vocab, other_vocab = _vocab_size(policy), _vocab_size(other)
    if other_vocab != vocab or _tokenizer_vocab(policy) != _tokenizer_vocab(other):
        raise ValueError(
            f"{field} ({other_model}) and policy.model_name ({policy_model}) have different "
            f"tokenizers or vocabulary sizes ({other_vocab} vs {vocab}); {why}"
        )
    return vocab


def _vocab_size(model_path: str) -> int:
    """``vocab_size`` of an HF folder's config.json."""
    return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])


def _tokenizer_vocab(model_path: str) -> dict[str, int]:
    """Token -> id of an HF folder's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path).get_vocab()


def plan_gpu_memory(
    policy: PolicyConfig, cluster: ClusterConfig, with_generation: bool
) -> MemoryPlan | NoMemoryPlan:
    """The per-GPU memory plan of training ``policy`` on the cluster's GPUs (each of
    ``cluster.gpu_memory_gb``), with its vLLM engines when ``with_generation``; none on CPU or
    for a model whose shape is not here (:mod:`nemo_rl.models.policy.gpu_memory`). Its
    ``check()`` refuses a plan that does not fit."""
    if not cluster.gpus_per_node:
        return NoMemoryPlan("a CPU run: cluster.gpus_per_node is 0")
    world, _ = cluster.ranks
    return plan_policy_memory(policy, world, cluster.gpu_memory_gb, with_generation)


def check_generation_layout(
    tensor_parallel_size: int, cluster: ClusterConfig, field: str
) -> GenerationLayout:
    """Generation engines of ``tensor_parallel_size`` bundles (``field``) against the bundles
    of each node the cluster section gives; returns the replicas x ranks layout."""
    slots, name = cluster.slots_per_node
    return plan_generation_layout(
        [slots] * cluster.num_nodes, tensor_parallel_size, f"{name} = {slots}", field
    )


def derive_lr_decay_iters(policy: PolicyConfig, optimizer_steps: int, steps_key: str) -> None:
    """Fill ``policy.megatron_cfg.scheduler.lr_decay_iters`` (when unset) with the run's
    ``optimizer_steps``; a 'constant' schedule whose run ends inside the warm-up gets
    ``lr_warmup_iters + 1`` (the horizon of a constant schedule only has to exceed the
    warm-up); a decaying one is refused, naming ``steps_key`` (the key setting the run length).

    Raises:
        ValueError: a decaying schedule whose warm-up outlasts the run.
    """
    scheduler = policy.megatron_cfg.scheduler
    if scheduler.lr_decay_iters is not None:
        return
    run = optimizer_steps
    if run <= scheduler.lr_warmup_iters:
        if scheduler.lr_decay_style != "constant":
            raise ValueError(
                f"the run has {run} optimizer steps ({steps_key} x optimizer steps per step), "
                f"not more than policy.megatron_cfg.scheduler.lr_warmup_iters "
                f"({scheduler.lr_warmup_iters}), so the {scheduler.lr_decay_style!r} decay never "
                f"starts; raise {steps_key}, lower lr_warmup_iters, or set lr_decay_iters"
            )
        run = scheduler.lr_warmup_iters + 1
    scheduler.lr_decay_iters = run


def check_checkpoint_metric(
    ckpt: CheckpointingConfig, validates: bool, section: str, examples: tuple[str, str]
) -> None:
    """With ``keep_top_k``, ``checkpointing.metric_name`` must be a metric the loop records:
    ``val_<validation metric>`` (only when the run validates) or ``train_<train metric>``.

    Args:
        validates: whether the run validates (``<section>.val_period`` or ``val_at_start``).
        section: the algorithm's config section (``grpo``, ``sft``, ``dpo``), for the message.
        examples: a validation and a train metric of the algorithm for the message (e.g.
            ``("val_reward", "train_reward")``).

    Raises:
        ValueError: naming the metric and the ways out.
    """
    if not ckpt.enabled or ckpt.keep_top_k is None:
        return
    val_example, train_example = examples
    if not ckpt.metric_name.startswith(("val_", "train_")):
        raise ValueError(
            f"checkpointing.metric_name={ckpt.metric_name!r} is not a metric the "
            f"{section.upper()} loop records: checkpoints are ranked by val_<validation "
            f"metric> (e.g. {val_example}) or train_<training metric> (e.g. {train_example}); use "
            "one, or set checkpointing.keep_top_k=null"
        )
    if ckpt.metric_name.startswith("val_") and not validates:
        raise ValueError(
            f"checkpointing.metric_name={ckpt.metric_name!r} ranks checkpoints by a validation "
            f"metric but validation is off ({section}.val_period=0, {section}.val_at_start="
            f"false); rank by a train metric (e.g. {train_example}), turn validation on, or set "
            "checkpointing.keep_top_k=null"
        )


def check_reward_head(policy: PolicyConfig, command: str, trains_reward_model: bool) -> None:
    """``policy.reward_model_cfg.enabled`` is true exactly for the reward-model command (a
    policy with a scalar head has no LM head to score tokens or generate with).

    Raises:
        ValueError: naming the key and the value ``command`` needs.
    """
    enabled = policy.reward_model_cfg.enabled
    if enabled != trains_reward_model:
        raise ValueError(
            f"policy.reward_model_cfg.enabled={str(enabled).lower()} but `nemo-rl {command}` "
            + ("trains a reward model: set it to true" if trains_reward_model else
               "trains a language model (only `nemo-rl rm` trains a reward model): set it to false")
        )


class SupervisedLoopConfig(ConfigModel):
    """Loop keys of the supervised algorithms (``sft``, ``dpo``, ``rm``; NeMo RL's names).

    The run trains ``min(max_num_steps, max_num_epochs x batches per epoch)`` steps.
    """

    max_num_epochs: int = Field(
        default=1, ge=1, description="Passes over the training data at most."
    )
    max_num_steps: int = Field(default=60, ge=1, description="Training steps at most.")
    val_period: int = Field(
        default=10, ge=0, description="Validate every this many steps; 0 disables."
    )
    val_batches: int = Field(
        default=8,
        ge=0,
        description="Validation batches of val_global_batch_size per validation; 0: the whole "
        "validation set.",
    )
    val_global_batch_size: int = Field(
        default=32, ge=1, description="Samples per validation batch."
    )
    val_micro_batch_size: int = Field(
        default=1, ge=1, description="Samples per validation micro-batch."
    )
    val_at_start: bool = Field(default=True, description="Validate once before the first step.")
    seed: int = Field(default=42, description="Seed of the data order and initialisation.")

    @property
    def validates(self) -> bool:
        """Whether the run validates at all."""
        return self.val_period > 0 or self.val_at_start


class SupervisedDataConfig(ConfigModel):
    """Data files of a supervised run, or the built-in synthetic arithmetic task (``data``)."""

    train_path: str | None = Field(
        default=None,
        description="Training file (.jsonl, .json or .parquet). None: rows of the synthetic "
        "task (data.synthetic).",
    )
    val_path: str | None = Field(
        default=None,
        description="Validation file (.jsonl, .json or .parquet). None: the synthetic task's "
        "validation rows without train_path, else no validation.",
    )
    shuffle: bool = Field(default=True, description="Shuffle the training rows every epoch.")
    synthetic: SyntheticArithmeticConfig = Field(
        default_factory=SyntheticArithmeticConfig,
        description="The synthetic arithmetic task, used without train_path.",
    )

    @model_validator(mode="after")
    def _check_files(self) -> SupervisedDataConfig:
        for name in ("train_path", "val_path"):
            path = getattr(self, name)
            if path is not None:
                check_data_file(path, f"data.{name}")
        if self.val_path is not None and self.train_path is None:
            raise ValueError(
                "data.val_path is set without data.train_path: the synthetic task has its own "
                "validation rows; set train_path too, or remove val_path"
            )
        return self


class SupervisedMasterConfig(ConfigModel):
    """Sections every supervised recipe has (the policy, its machines, logging, checkpoints)
    and the checks spanning them; a subclass adds its loop section, named by ``LOOP_SECTION``,
    and ``data``."""

    LOOP_SECTION: ClassVar[str] = ""
    TRAINS_REWARD_MODEL: ClassVar[bool] = False

    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="The trained policy.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Machines.")
    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Metric logging.")
    checkpointing: CheckpointingConfig = Field(
        default_factory=CheckpointingConfig, description="Checkpointing."
    )

    @model_validator(mode="after")
    def _check_run(self) -> SupervisedMasterConfig:
        """The parallel layout against the cluster and the batch sizes, the validation batch
        against DP, the checkpoint metric; then fill the learning-rate horizon."""
        section = self.LOOP_SECTION
        loop: SupervisedLoopConfig = getattr(self, section)
        check_reward_head(self.policy, section, self.TRAINS_REWARD_MODEL)
        dp = check_parallel_layout(self.policy, self.cluster).dp
        val = loop.val_global_batch_size
        if loop.validates and (val % dp or (val // dp) % loop.val_micro_batch_size):
            raise ValueError(
                f"{section}.val_global_batch_size ({val}) must split over the {dp} data-parallel "
                f"replicas into whole micro-batches of {section}.val_micro_batch_size "
                f"({loop.val_micro_batch_size}); change one of them"
            )
        check_checkpoint_metric(self.checkpointing, loop.validates, section, ("val_loss", "train_loss"))
        derive_lr_decay_iters(self.policy, loop.max_num_steps, f"{section}.max_num_steps")
        self.memory_plan().check()
        return self

    def memory_plan(self) -> MemoryPlan | NoMemoryPlan:
        """The run's per-GPU memory plan (training only: no generation engines)."""
        return plan_gpu_memory(self.policy, self.cluster, with_generation=False)
