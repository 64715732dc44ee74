"""Typed config of the trained policy (``policy``): model, batching, Megatron-Core, generation.

Key names follow NeMo RL's. Fields documented "None: X" are derived after validation by
:meth:`PolicyConfig._derive_and_check`, so a derived value follows the field it comes from
when that field is overridden. The objects themselves go to the workers (they pickle through
Ray); nothing downstream re-reads a dumped dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_bridge.lora_targets import check_selection
from nemo_rl.models.generation.config import GenerationConfig, Precision
from nemo_rl.models.generation.lora_serving import AdapterServing, engine_max_lora_rank
from nemo_rl.models.generation.refit.buckets import ALIGNMENT
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.utils.config import ConfigModel, validate_config


class MegatronOptimizerConfig(ConfigModel):
    """Megatron-Core optimizer (``policy.megatron_cfg.optimizer``)."""

    optimizer: Literal["adam", "sgd"] = Field(
        default="adam", description="Update rule: 'adam' (AdamW, decoupled weight decay) or 'sgd'."
    )
    lr: float = Field(default=5.0e-6, gt=0.0, description="Peak learning rate.")
    min_lr: float = Field(
        default=5.0e-7, ge=0.0, description="Floor of the decayed learning rate; must be <= lr."
    )
    weight_decay: float = Field(default=0.01, ge=0.0, description="Decoupled weight-decay factor.")
    adam_beta1: float = Field(
        default=0.9, ge=0.0, lt=1.0, description="Adam decay rate of the first-moment estimate."
    )
    adam_beta2: float = Field(
        default=0.999, ge=0.0, lt=1.0, description="Adam decay rate of the second-moment estimate."
    )
    adam_eps: float = Field(
        default=1.0e-8, gt=0.0, description="Adam denominator term for numerical stability."
    )
    clip_grad: float = Field(
        default=1.0, ge=0.0, description="Global gradient-norm clipping threshold; 0 disables."
    )
    use_distributed_optimizer: bool = Field(
        default=True,
        description="Shard optimizer state across data-parallel ranks (ZeRO-1 style).",
    )

    @model_validator(mode="after")
    def _check_lr_range(self) -> MegatronOptimizerConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        return self

class MegatronSchedulerConfig(ConfigModel):
    """Learning-rate schedule (``policy.megatron_cfg.scheduler``), counted in optimizer steps."""

    lr_decay_style: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="Shape of the decay from lr to min_lr after warm-up."
    )
    lr_warmup_iters: int = Field(
        default=0, ge=0, description="Optimizer steps of linear warm-up from 0 to lr."
    )
    lr_decay_iters: int | None = Field(
        default=None,
        ge=1,
        description="Optimizer step at which lr reaches min_lr; must exceed lr_warmup_iters. "
        "None: the whole run, filled in by the algorithm's master config (GRPO: "
        "grpo.max_num_steps x optimizer steps per GRPO step, or lr_warmup_iters + 1 for a "
        "'constant' schedule whose run ends within the warm-up; an SFT warm start has its own "
        "schedule).",
    )

    @model_validator(mode="after")
    def _check_horizon(self) -> MegatronSchedulerConfig:
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(
                f"lr_decay_iters ({self.lr_decay_iters}) must exceed lr_warmup_iters "
                f"({self.lr_warmup_iters}); raise lr_decay_iters or lower lr_warmup_iters"
            )
        return self

class PeftConfig(ConfigModel):
    """LoRA adapters on the Megatron policy (``policy.megatron_cfg.peft``, NeMo RL's keys).

    The base weights are frozen (no gradient, no optimizer state) and every selected linear
    layer learns ``W + (alpha / dim) * B A``; the reference policy of KL penalties and DPO is
    the base model with the adapters switched off. Module names and matching:
    :mod:`megatron_bridge.lora_targets`.
    """

    enabled: bool = Field(default=False, description="Train LoRA adapters instead of all weights.")
    target_modules: list[str] = Field(
        default_factory=list,
        description="Linear layers to adapt: Megatron names (linear_qkv, linear_proj, "
        "linear_fc1, linear_fc2), Hugging Face projection names (q_proj, k_proj, v_proj "
        "together, o_proj, gate_proj and up_proj together, down_proj) or patterns over full "
        "names such as '*.layers.0.*.linear_qkv'. Empty: every linear layer of the decoder "
        "(the embedding and LM head are never adapted).",
    )
    exclude_modules: list[str] = Field(
        default_factory=list,
        description="Linear layers not to adapt (same names and patterns); only with an empty "
        "target_modules.",
    )
    dim: int = Field(default=32, ge=1, description="Rank of the adapters (r).")
    alpha: float = Field(
        default=32, gt=0.0, description="The update is scaled by alpha / dim."
    )
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Dropout probability on the adapter path."
    )
    dropout_position: Literal["pre", "post"] = Field(
        default="pre",
        description="Dropout on the adapter's input ('pre') or on its output ('post').",
    )
    lora_A_init_method: Literal["xavier", "uniform"] = Field(
        default="xavier",
        description="Initialisation of A: 'xavier' (Glorot normal) or 'uniform' (Kaiming "
        "uniform with a = sqrt(5), torch.nn.Linear's default).",
    )
    lora_B_init_method: Literal["zero"] = Field(
        default="zero",
        description="Initialisation of B: 'zero', so the adapted model starts as the base.",
    )
    lora_dtype: Precision | None = Field(
        default=None,
        description="Parameter dtype of the adapters; None: the policy's precision.",
    )

    @model_validator(mode="after")
    def _check_module_names(self) -> PeftConfig:
        check_selection(self.target_modules, self.exclude_modules)
        return self


class MegatronConfig(ConfigModel):
    """Megatron-Core training backend (``policy.megatron_cfg``): parallelism and optimizer."""

    enabled: bool = Field(default=True, description="Train with Megatron-Core.")
    tensor_model_parallel_size: int = Field(
        default=1, ge=1, description="Ranks each layer's weights are split over (TP)."
    )
    pipeline_model_parallel_size: int = Field(
        default=1, ge=1, description="Pipeline stages the layers are split into (PP)."
    )
    context_parallel_size: int = Field(
        default=1, ge=1, description="Ranks each sequence is split over along its length (CP)."
    )
    sequence_parallel: bool = Field(
        default=False,
        description="Also split norms and dropout activations along the sequence over the TP "
        "ranks (model rows are padded to a multiple of TP); needs tensor_model_parallel_size "
        "> 1, and a mixture-of-experts model trains at TP > 1 only with it. Works on the local "
        "layer spec (CPU) as with TransformerEngine.",
    )
    make_vocab_size_divisible_by: int = Field(
        default=128,
        ge=1,
        description="Pad the embedding rows to a multiple of this (times TP), in tokens.",
    )
    optimizer: MegatronOptimizerConfig = Field(
        default_factory=MegatronOptimizerConfig, description="Optimizer settings."
    )
    scheduler: MegatronSchedulerConfig = Field(
        default_factory=MegatronSchedulerConfig, description="Learning-rate schedule."
    )
    compile_transformer_layers: bool = Field(
        default=False,
        description="torch.compile each transformer layer on its own (regional compilation, "
        "as torchtitan does): fuses RoPE, SwiGLU, residual adds and casts between the "
        "matmuls. Costs a compile at the first step and at each new micro-batch shape. Off "
        "until a GPU run measures it (docs/performance.md).",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Recompute each layer's activations in the backward pass: less memory, "
        "about a third more compute.",
    )
    expert_model_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Ranks the experts of each mixture-of-experts layer are split over (EP), "
        "whole experts per rank; taken out of the data-parallel x context-parallel ranks. "
        "Must divide the model's expert count; > 1 needs a mixture-of-experts model.",
    )
    expert_tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="Ranks each expert's weights are split over (ETP). None: "
        "tensor_model_parallel_size, the only value supported (the checkpoint bridge splits "
        "experts like the dense MLP).",
    )
    moe_router_dtype: Literal["fp32", "fp64"] | None = Field(
        default="fp32",
        description="Dtype of the router's logits, softmax and top-k ('fp64' makes the "
        "expert choice more reproducible); None: the parameter dtype.",
    )
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = Field(
        default="aux_loss",
        description="Router load-balancing loss: 'aux_loss' (Switch-style, over each "
        "micro-batch's tokens), 'seq_aux_loss' (per sequence) or 'none'.",
    )
    moe_aux_loss_coeff: float | None = Field(
        default=None,
        ge=0.0,
        description="Weight of the load-balancing loss added to the training loss (its "
        "gradient is averaged over the global batch's tokens as megatron-core's per-token loss "
        "does). None: the checkpoint's router_aux_loss_coef, 0 when it has none.",
    )
    moe_z_loss_coeff: float | None = Field(
        default=None,
        ge=0.0,
        description="Weight of the router z-loss (mean squared logsumexp of the router "
        "logits) added to the training loss; None: off.",
    )
    distributed_timeout_minutes: float = Field(
        default=10.0,
        gt=0.0,
        description="Minutes any one collective of the policy's process groups (the world's "
        "and megatron's TP/PP/CP/DP/EP groups) may wait for its peers before it fails: a "
        "rank that stopped or died then stops the run with one line naming the rank, the "
        "call and this bound (exit 75) instead of a hang. Keep it above the longest "
        "collective (a checkpoint load's on a slow filesystem).",
    )
    moe_grouped_gemm: bool = Field(
        default=True,
        description="Run each layer's local experts as two grouped GEMMs (torch._grouped_mm: "
        "CUTLASS kernels on Hopper and newer) instead of megatron's loop over the experts; "
        "same parameters, checkpoints and refit. false: the loop (needed for experts with "
        "biases or fp8).",
    )
    peft: PeftConfig = Field(
        default_factory=PeftConfig, description="LoRA adapters instead of full training."
    )
    freeze_moe_router: bool = Field(
        default=False,
        description="Keep the routers' weights fixed (no gradient, no update): RL then "
        "changes the experts but not which tokens reach them.",
    )

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> MegatronConfig:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=true splits activations over the TP ranks and needs "
                "tensor_model_parallel_size > 1; set sequence_parallel=false or raise TP"
            )
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp != self.tensor_model_parallel_size:
            raise ValueError(
                f"expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size="
                f"{self.tensor_model_parallel_size}: only experts split like the dense layers "
                "are supported; set expert_tensor_parallel_size to null or to "
                f"{self.tensor_model_parallel_size}"
            )
        return self

    def lr_schedule(
        self, overrides: Mapping[str, Any]
    ) -> tuple[MegatronOptimizerConfig, MegatronSchedulerConfig]:
        """The optimizer and scheduler settings with ``overrides`` applied and validated.

        Args:
            overrides: ``lr`` / ``min_lr`` (optimizer) and ``lr_decay_style`` /
                ``lr_warmup_iters`` / ``lr_decay_iters`` (scheduler) of another schedule,
                e.g. :meth:`nemo_rl.algorithms.sft.SFTWarmupConfig.lr_schedule`.

        Raises:
            ConfigError: a key neither model has (named, with the nearest valid one) or a
                value the models refuse.
        """
        optimizer = self.optimizer.model_dump()
        scheduler = self.scheduler.model_dump()
        for key, value in overrides.items():
            (optimizer if key in ("lr", "min_lr") else scheduler)[key] = value
        return (
            validate_config(optimizer, MegatronOptimizerConfig, source="lr schedule"),
            validate_config(scheduler, MegatronSchedulerConfig, source="lr schedule"),
        )


class DynamicBatchingConfig(ConfigModel):
    """Micro-batches cut by a token budget, not a sample count (``policy.dynamic_batching``)."""

    enabled: bool = Field(default=False, description="Use token-budgeted micro-batches.")
    train_mb_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Token budget of one training micro-batch (padded lengths). "
        "None: max_total_sequence_length * train_micro_batch_size.",
    )
    logprob_mb_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Token budget of one logprob micro-batch (padded lengths). "
        "None: max_total_sequence_length * logprob_batch_size.",
    )
    sequence_length_round: int = Field(
        default=64,
        ge=1,
        description="Pad each micro-batch's sequence length up to a multiple of this, in tokens.",
    )


class SequencePackingConfig(ConfigModel):
    """Several sequences concatenated into one row, no padding (``policy.sequence_packing``)."""

    enabled: bool = Field(default=False, description="Pack sequences into micro-batches.")
    train_mb_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens in one packed training micro-batch. "
        "None: max_total_sequence_length * train_micro_batch_size.",
    )
    logprob_mb_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens in one packed logprob micro-batch. "
        "None: max_total_sequence_length * logprob_batch_size.",
    )
    algorithm: Literal["first_fit_decreasing", "modified_first_fit_decreasing"] = Field(
        default="modified_first_fit_decreasing",
        description="Bin-packing heuristic that assigns sequences to micro-batches.",
    )


class TokenizerConfig(ConfigModel):
    """Tokenizer of the policy (``policy.tokenizer``)."""

    name: str | None = Field(
        default=None,
        description="Hub name or local folder of the tokenizer. None: policy.model_name.",
    )
    chat_template: str | None = Field(
        default=None,
        description="Jinja chat template replacing the tokenizer's own. None: keep the "
        "tokenizer's template.",
    )


class RewardModelConfig(ConfigModel):
    """The policy as a reward model (``policy.reward_model_cfg``, NeMo RL's keys): the decoder
    with a scalar score head (``[1, hidden]``, initialised N(0, initializer_range^2) from the
    loop's seed) in place of the LM head. Only ``nemo-rl rm`` trains one."""

    enabled: bool = Field(
        default=False, description="Replace the LM head by a scalar reward head."
    )
    reward_model_type: Literal["bradley_terry"] = Field(
        default="bradley_terry",
        description="How the reward is trained: 'bradley_terry' (-log sigmoid(r_chosen - "
        "r_rejected) on preference pairs).",
    )


class PolicyConfig(ConfigModel):
    """The model being trained and how it is batched, trained and sampled (``policy``)."""

    model_name: str = Field(
        default="tiny-llama",
        min_length=1,
        description="Hugging Face hub name, local checkpoint folder, or a built-in tiny model "
        "('tiny-llama', 'tiny-qwen2') built locally on first use.",
    )
    tokenizer: TokenizerConfig = Field(
        default_factory=TokenizerConfig, description="Tokenizer settings."
    )
    train_global_batch_size: int = Field(
        default=32,
        ge=1,
        description="Samples (prompt-response pairs) per optimizer step, over all "
        "data-parallel ranks.",
    )
    train_micro_batch_size: int = Field(
        default=4,
        ge=1,
        description="Samples per forward/backward pass on one data-parallel rank.",
    )
    logprob_batch_size: int = Field(
        default=8, ge=1, description="Samples per forward pass when computing logprobs."
    )
    max_total_sequence_length: int = Field(
        default=256, ge=2, description="Longest prompt + response, in tokens."
    )
    logprob_chunk_size: int | None = Field(
        default=1024,
        ge=1,
        description="Tokens whose logits exist at once when the Megatron worker scores tokens "
        "(logprob passes and the training step of logprob losses: NLL, GRPO, DPO): the LM "
        "head is fused with the log-softmax and run chunk by chunk, forward and backward, so "
        "the [tokens, vocab] logits and their float32 copy and gradient never exist in full. "
        "None: the output layer's full logits, then the logprobs (the un-fused path; "
        "distillation, reward models and top-k scoring always take it).",
    )
    precision: Precision = Field(
        default="float32",
        description="Parameter and activation dtype of training ('float32' on CPU).",
    )
    megatron_cfg: MegatronConfig = Field(
        default_factory=MegatronConfig, description="Megatron-Core backend settings."
    )
    reward_model_cfg: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="The policy as a reward model."
    )
    dynamic_batching: DynamicBatchingConfig = Field(
        default_factory=DynamicBatchingConfig, description="Token-budgeted micro-batching."
    )
    sequence_packing: SequencePackingConfig = Field(
        default_factory=SequencePackingConfig, description="Sequence packing."
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Rollout generation settings."
    )
    refit_buffer_size_gb: float = Field(
        default=0.25,
        gt=0,
        description="Most bytes one weight-refit bucket holds, GiB (rounded down to 64 "
        "bytes); a tensor larger than this travels alone in a bucket of its size. A refit "
        "stages two buckets per ring (a ring per node on CPU, per GPU when colocated on GPU, "
        "per engine over a broadcast), whatever the model's size (docs/architecture.md, "
        "weight sync).",
    )
    refit_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Seconds any one refit step (a bucket, forming the broadcast group, a "
        "broadcast, the engines' load) may take before the refit fails.",
    )
    refit_checksums: bool = Field(
        default=False,
        description="Stamp every refit bucket with a 64-bit checksum the engines verify "
        "before loading, so a corrupted bucket is refused instead of loaded. Off by default: "
        "one more read of the weights on each side (a quarter of a colocated CPU refit, "
        "docs/performance.md, refit) for a check of the transport itself; order, version, "
        "sizes and the tensor manifest are always checked.",
    )
    refit_max_retries: int = Field(
        default=2,
        ge=0,
        description="Times the driver starts a failed refit over (a corrupt bucket, a stream "
        "that broke off) before it stops the run; engines whose load broke off refuse to "
        "generate until a refit completes.",
    )
    call_timeout_s: float = Field(
        default=3600.0,
        gt=0.0,
        description="Seconds the driver waits for the policy workers to answer one call (a "
        "training step's batch, a logprob pass, a checkpoint save or load, a refit verb); "
        "past it the run stops with one line naming the ranks that did not answer, their "
        "nodes and the call (exit 75: a stopped or hung worker, or ranks waiting for one). "
        "A worker that dies stops the run at once, whatever this bound.",
    )

    @model_validator(mode="after")
    def _derive_and_check(self) -> PolicyConfig:
        """Check cross-field constraints, then fill the fields documented "None: X"."""
        if self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(
                f"train_global_batch_size ({self.train_global_batch_size}) must be a multiple "
                f"of train_micro_batch_size ({self.train_micro_batch_size})"
            )
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError(
                "dynamic_batching.enabled and sequence_packing.enabled are both true; "
                "enable at most one"
            )
        vllm = self.generation.vllm_cfg
        if vllm.max_model_len is not None and vllm.max_model_len < self.max_total_sequence_length:
            raise ValueError(
                f"generation.vllm_cfg.max_model_len ({vllm.max_model_len}) must be >= "
                f"max_total_sequence_length ({self.max_total_sequence_length}); set it to "
                "${policy.max_total_sequence_length} or more"
            )
        if self.generation.temperature == 0:
            raise ValueError(
                "generation.temperature is 0 (greedy decoding): the trained policy's logprobs "
                "follow the engines' sampling distribution, and greedy decoding has none to "
                "train on; sample with a temperature > 0 (validation may still decode "
                "greedily: val_greedy=true in the algorithm's section)"
            )
        if self.megatron_cfg.peft.enabled and self.reward_model_cfg.enabled:
            raise ValueError(
                "megatron_cfg.peft.enabled with reward_model_cfg.enabled: a reward model's "
                "new score head must be trained in full, which LoRA does not do; disable one"
            )
        peft = self.megatron_cfg.peft
        if self.generation.vllm_cfg.lora_refit == "adapter" and not peft.enabled:
            raise ValueError(
                "generation.vllm_cfg.lora_refit='adapter' serves LoRA adapters, but "
                "megatron_cfg.peft.enabled is false; set lora_refit: merged or enable peft"
            )
        if self.generation.vllm_cfg.lora_refit == "adapter":
            try:
                engine_max_lora_rank(peft.dim)
            except ValueError as err:
                raise ValueError(
                    f"megatron_cfg.peft.dim={peft.dim} with generation.vllm_cfg.lora_refit="
                    f"'adapter': {err}; set lora_refit: merged or a smaller dim"
                ) from None
        if self.tokenizer.name is None:
            self.tokenizer.name = self.model_name
        seq_len = self.max_total_sequence_length
        for section in (self.dynamic_batching, self.sequence_packing):
            if section.train_mb_tokens is None:
                section.train_mb_tokens = seq_len * self.train_micro_batch_size
            if section.logprob_mb_tokens is None:
                section.logprob_mb_tokens = seq_len * self.logprob_batch_size
        return self

    def adapter_serving(self) -> AdapterServing | None:
        """The adapters the engines serve themselves (``generation.vllm_cfg.lora_refit:
        adapter`` on a LoRA policy); None when the engines get every weight (merged)."""
        peft = self.megatron_cfg.peft
        if not peft.enabled or self.generation.vllm_cfg.lora_refit != "adapter":
            return None
        return AdapterServing(dim=peft.dim, alpha=peft.alpha)

    def refit_settings(self) -> RefitSettings:
        """How this policy streams its weights into the engines: buckets of
        ``refit_buffer_size_gb``, exported in the engines' precision
        (``generation.vllm_cfg.precision``)."""
        bucket_bytes = int(self.refit_buffer_size_gb * 1024**3) // ALIGNMENT * ALIGNMENT
        bucket_bytes = max(ALIGNMENT, bucket_bytes)
        return RefitSettings(
            bucket_bytes=bucket_bytes,
            dtype=self.generation.vllm_cfg.precision,
            timeout_s=self.refit_timeout_s,
            checksums=self.refit_checksums,
            max_retries=self.refit_max_retries,
        )
