"""Set up one rank of a Megatron policy: process groups, GPTModel, DDP, optimizer, scheduler.

Rank and rendezvous come from the environment ``RayWorkerGroup`` sets (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); TP/PP/CP/EP come from ``megatron_cfg`` and data
parallelism takes the rest (``DP = world / (TP * PP * CP)``; the expert-parallel ranks EP come
out of DP x CP, megatron-core's expert grid).

Loss scaling convention: our losses are globally normalised (micro-batch losses SUM to the
global loss), so the transformer config sets ``calculate_per_token_loss``: megatron's schedule
then neither divides the loss by the micro-batch count nor multiplies it by the CP size, and
DDP sums gradients over the data-parallel (and CP) ranks instead of averaging them.
:func:`finalize_grads` is megatron's ``finalize_model_grads`` without its token-count scaling.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_bridge import BridgeConfig, dtype_from_name, load_hf_weights
from megatron_bridge.cpu_compat import is_cpu_run
from megatron_bridge.load import gpt_model_stage
from megatron_bridge.parallel_state import initialize_megatron_parallel
from nemo_rl.distributed.sampling import PLAIN_SAMPLING, TrainingSamplingParams
from nemo_rl.models.megatron import torch_fused
from nemo_rl.models.megatron.compiled_layers import compile_transformer_layers
from nemo_rl.models.megatron.context_parallel_layer_specs import get_gpt_stage_spec
from nemo_rl.models.megatron.optimizer_parts import optimizer_parts
from nemo_rl.models.policy.workers.megatron.moe import freeze_routers, moe_overrides

if TYPE_CHECKING:
    from megatron_bridge.lora import LoraSpec
    from nemo_rl.models.policy.config import (
        MegatronConfig,
        MegatronOptimizerConfig,
        MegatronSchedulerConfig,
        PolicyConfig,
    )

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP x CP x DP x PP grid (megatron's rank order, TP fastest);
    ``ep`` is the expert-parallel size (1 for a dense model)."""

    rank: int
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int = 1


@dataclass
class PolicyModel:
    """Everything a trainable rank holds.

    Attributes:
        model: the DDP-wrapped GPTModel stage (``model.module`` is the GPTModel); a
            :class:`FrozenStage` for a policy built without an optimizer.
        optimizer: megatron optimizer over ``model``'s parameters; None when frozen.
        scheduler: learning-rate / weight-decay scheduler stepping once per optimizer step;
            None when frozen.
        bridge: the HF <-> Megatron description of the model (vocabulary, family).
        layout: parallel sizes of this run.
        dtype: parameter dtype.
        lora: the model's LoRA adapters (``megatron_cfg.peft``); None when it has none.
        logprob_chunk_size: ``policy.logprob_chunk_size``: tokens per chunk of the LM head
            fused with the logprobs; None: the output layer's full logits.
        sampling: the engines' sampling distribution (``policy.generation``'s temperature,
            top-k, top-p) that the policy's logprobs follow.
    """

    model: Any
    optimizer: Any | None
    scheduler: Any | None
    bridge: BridgeConfig
    layout: ParallelLayout
    dtype: torch.dtype
    lora: LoraSpec | None = None
    logprob_chunk_size: int | None = None
    sampling: TrainingSamplingParams = PLAIN_SAMPLING


class FrozenStage(torch.nn.Module):
    """A GPTModel stage that only scores (a distillation teacher): no DDP, so no gradient
    buffers, and parameters that need no gradient. ``module`` is the GPTModel, as on DDP, so
    scoring, refit and export read both alike."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module.requires_grad_(False)

    @property
    def config(self) -> Any:
        """The GPTModel's ``TransformerConfig``, as DDP exposes it."""
        return self.module.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def require_optimizer(policy: PolicyModel, action: str) -> None:
    """Refuse ``action`` (train, save a training checkpoint...) on a policy built without an
    optimizer.

    Raises:
        RuntimeError: naming the fix.
    """
    if policy.optimizer is None:
        raise RuntimeError(
            f"cannot {action}: this policy was built with init_optimizer=False (a frozen "
            "teacher: no optimizer, no gradient buffers) and only scores; build it with "
            "init_optimizer=True to train it"
        )


def init_parallel_from_env(megatron_cfg: MegatronConfig, seed: int) -> ParallelLayout:
    """Initialise torch.distributed and megatron's TP/PP/CP/EP groups from the environment.

    Raises:
        ValueError: the world size is not a multiple of TP * PP * CP (or TP * EP * PP), or
            sequence parallelism is asked for without TP > 1.
        KeyError: a rendezvous variable (RANK, WORLD_SIZE, MASTER_PORT) is missing.
    """
    tp = megatron_cfg.tensor_model_parallel_size
    pp = megatron_cfg.pipeline_model_parallel_size
    cp = megatron_cfg.context_parallel_size
    ep = megatron_cfg.expert_model_parallel_size
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % (tp * pp * cp):
        raise ValueError(
            f"WORLD_SIZE ({world}) is not a multiple of megatron_cfg tensor_model_parallel_size *"
            f" pipeline_model_parallel_size * context_parallel_size ({tp}*{pp}*{cp}); change "
            f"the parallel sizes or the number of workers"
        )
    if megatron_cfg.sequence_parallel and tp == 1:
        raise ValueError(
            "megatron_cfg.sequence_parallel needs tensor_model_parallel_size > 1; disable it"
        )
    initialize_megatron_parallel(
        rank,
        world,
        tp=tp,
        pp=pp,
        cp=cp,
        master_port=int(os.environ["MASTER_PORT"]),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        seed=seed,
        timeout_s=megatron_cfg.distributed_timeout_minutes * 60,
        ep=ep,
    )
    return ParallelLayout(rank, world, tp, pp, cp, world // (tp * pp * cp), ep)


def build_gpt_stage(
    model_path: str, config: PolicyConfig, layout: ParallelLayout, dtype: torch.dtype
) -> tuple[torch.nn.Module, BridgeConfig, Any]:
    """This rank's GPTModel stage with the HF weights of ``model_path`` loaded.

    Without TransformerEngine the layer spec's attention is our CP- and packing-capable one
    (megatron's local attention supports neither). Shares the construction with
    :func:`megatron_bridge.build_gpt_model` (:func:`megatron_bridge.load.gpt_model_stage`) and
    adds the CP size, activation recomputation, the loss-scaling flags training needs and, for
    a mixture-of-experts model, the router's training settings (:mod:`.moe`; the routers are
    frozen here with ``freeze_moe_router``). With the scalar head (``reward_model_cfg.enabled``)
    and a reward model's folder (a ``...ForSequenceClassification``, as ``nemo-rl export``
    writes one) the stage gets its :class:`~.reward_head.ScalarHead` before loading, which the
    folder's trained ``score.weight`` then fills.

    Returns:
        ``(model, bridge, transformer_config)``.
    """
    mcfg = config.megatron_cfg
    bridge = BridgeConfig.from_hf(
        model_path, make_vocab_size_divisible_by=mcfg.make_vocab_size_divisible_by
    )
    base = bridge.transformer_config(layout.tp, layout.pp, dtype, ep=layout.ep)
    recompute: dict[str, Any] = {}
    if mcfg.activation_checkpointing:
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    tconfig = dataclasses.replace(
        base,
        context_parallel_size=layout.cp,
        sequence_parallel=mcfg.sequence_parallel,
        calculate_per_token_loss=True,
        # Micro-batches of dynamic batching and packing differ in length: PP stages exchange
        # shapes before activations.
        variable_seq_lengths=layout.pp > 1,
        # (dense models: only satisfies the config check that pairs with variable lengths)
        moe_token_dispatcher_type="alltoall",
        bias_activation_fusion=_fused_swiglu(base),
        **moe_overrides(mcfg, bridge),
        **recompute,
    )
    # LoRA adapts megatron-core's own parallel linears: the local spec, also where
    # TransformerEngine is installed (its linears fuse the norm into linear_qkv/linear_fc1).
    use_te = False if mcfg.peft.enabled else None
    spec = get_gpt_stage_spec(tconfig, use_te=use_te, grouped_experts=mcfg.moe_grouped_gemm)
    model = gpt_model_stage(bridge, tconfig, spec, layout.tp)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if config.reward_model_cfg.enabled and bridge.is_sequence_classifier:
        # a reward model's folder: its score head is loaded with the decoder
        from nemo_rl.models.policy.workers.megatron.reward_head import attach_reward_head

        attach_reward_head(model, torch.zeros(bridge.num_labels, model.config.hidden_size))
    load_hf_weights(model, bridge, model_path)
    tag_tensor_parallel_params(model)
    if mcfg.compile_transformer_layers:
        compile_transformer_layers(model)
    if mcfg.freeze_moe_router:
        freeze_routers(model)
    return model, bridge, tconfig


def add_lora_adapters(
    model: torch.nn.Module, config: PolicyConfig, bridge: BridgeConfig, model_path: str, seed: int
) -> LoraSpec:
    """Give ``model`` the LoRA adapters of ``megatron_cfg.peft`` and freeze everything else:
    only the adapters then need gradients, DDP buffers and optimizer state. Returns them."""
    from megatron_bridge.lora import attach_lora
    from megatron_bridge.lora_targets import is_adapter_param
    from nemo_rl.models.policy.peft import lora_spec

    spec = lora_spec(config.megatron_cfg.peft, bridge, model_path)
    attach_lora(model, spec, seed)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))
    return spec


def _fused_swiglu(config: Any) -> bool:
    """Whether megatron's fused SwiGLU (``bias_swiglu_impl``, built by ``torch.compile``) can
    replace the MLP's separate activation and product kernels: on CUDA, for a gated SiLU MLP.
    CPU runs keep the plain kernels (no compile step in tests and small jobs)."""
    return (
        torch.cuda.is_available()
        and config.gated_linear_unit
        and config.activation_func is torch.nn.functional.silu
    )


def tag_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Mark TP-split parameters the way megatron's own initialisation would.

    With ``perform_initialization=False`` (weights come from the checkpoint) megatron never
    sets ``tensor_model_parallel``/``partition_dim``; grad-norm and clipping would then count
    only TP rank 0's shards (they treat untagged parameters as TP duplicates).
    """
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    from megatron_bridge.load import partition_dims

    dims = partition_dims(model)
    for name, param in model.named_parameters():
        if dims.get(name) is not None and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, dims[name], 1)


def finalize_grads(
    model_chunks: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """Megatron's gradient finalisation (DP all-reduce, tied-embedding and SP norm
    reductions) without dividing by the token count: our losses are already normalised."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(
        model_chunks, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce
    )


def wrap_ddp(model: torch.nn.Module, tconfig: Any, use_distributed_optimizer: bool) -> Any:
    """Megatron DDP around ``model``; gradients are reduced in fp32 after the last micro-batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=model)
    tconfig.no_sync_func = ddp.no_sync
    tconfig.finalize_model_grads_func = finalize_grads
    return ddp


def build_optimizer(ddp: Any, opt_cfg: MegatronOptimizerConfig, dtype: torch.dtype) -> Any:
    """``get_megatron_optimizer`` from ``megatron_cfg.optimizer`` (fp32 master weights); its
    ``use_distributed_optimizer`` must be the one ``ddp`` was wrapped with."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch_fused.install()  # without TE/apex: no host sync per tensor in the grad norm
    config = OptimizerConfig(
        optimizer=opt_cfg.optimizer,
        lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        weight_decay=opt_cfg.weight_decay,
        adam_beta1=opt_cfg.adam_beta1,
        adam_beta2=opt_cfg.adam_beta2,
        adam_eps=opt_cfg.adam_eps,
        clip_grad=opt_cfg.clip_grad,
        use_distributed_optimizer=opt_cfg.use_distributed_optimizer,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    torch_fused.use_fused_adam(optimizer)  # on CUDA, where megatron fell back to torch's Adam
    return optimizer


def build_scheduler(
    optimizer: Any, opt_cfg: MegatronOptimizerConfig, sched_cfg: MegatronSchedulerConfig
) -> Any:
    """Linear warm-up from 0 to ``lr`` over ``lr_warmup_iters`` steps, then constant / cosine /
    linear decay to ``min_lr`` by ``lr_decay_iters`` (None: no decay horizon, i.e. constant
    after warm-up unless a decay style needs one, which then raises)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    style = sched_cfg.lr_decay_style
    warmup = sched_cfg.lr_warmup_iters
    decay = sched_cfg.lr_decay_iters
    if decay is None:
        if style != "constant":
            raise ValueError(
                f"megatron_cfg.scheduler.lr_decay_iters is None but lr_decay_style is {style!r}; "
                "set lr_decay_iters (optimizer steps) or use 'constant'"
            )
        decay = warmup + 1
    if decay <= warmup:
        raise ValueError(
            f"megatron_cfg.scheduler.lr_decay_iters ({decay}) must exceed lr_warmup_iters "
            f"({warmup})"
        )
    wd = opt_cfg.weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else opt_cfg.lr,
        max_lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def optimizer_states(optimizer: Any) -> Iterator[dict[str, Any]]:
    """Per-parameter state dicts of every torch optimizer inside a megatron optimizer (none
    for a frozen policy's None)."""
    if optimizer is None:
        return
    for opt in optimizer_parts(optimizer):
        yield from opt.optimizer.state.values()


def restart_optimizer(
    policy: PolicyModel, opt_cfg: MegatronOptimizerConfig, sched_cfg: MegatronSchedulerConfig
) -> None:
    """Zero the optimizer state in place (Adam moments and step counts, so bias correction
    starts over) and give ``policy`` a new scheduler from ``opt_cfg``/``sched_cfg`` at step 0.

    Weights (and fp32 master weights) are untouched: this is what starting a second training
    run from the current weights looks like, e.g. GRPO after an SFT warm start.
    """
    for state in optimizer_states(policy.optimizer):
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()
    # megatron's scheduler reads each param group's own max_lr/min_lr before its arguments
    for opt in optimizer_parts(policy.optimizer):
        for group in opt.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = opt_cfg.lr, opt_cfg.min_lr
    policy.scheduler = build_scheduler(policy.optimizer, opt_cfg, sched_cfg)


def effective_optimizer_config(
    opt_cfg: MegatronOptimizerConfig, announce: bool = True
) -> MegatronOptimizerConfig:
    """``opt_cfg`` as this process runs it: as given, except ``use_distributed_optimizer`` on
    the CPU path.

    CPU runs (the test bench) keep the plain optimizer, with which every CPU learning test was
    calibrated: the distributed optimizer sums gradients in another order (two steps of the
    tiny MoE model at EP=2: the same losses to 1e-7, parameters within 4e-5), and the tiny MoE
    GRPO recipe's 20-step learning check did not hold on the trajectory that followed. GPU runs
    keep the distributed optimizer; loading its checkpoints without TransformerEngine/Apex is
    handled in ``checkpointing`` (checked by ``gpu_check``'s ``resume``). With ``announce``
    (one rank of the group) the override is said in one warning line.
    """
    if is_cpu_run() and opt_cfg.use_distributed_optimizer:
        if announce:
            logger.warning(
                "policy.megatron_cfg.optimizer.use_distributed_optimizer=true overridden to "
                "false on CPU (the CPU test bench's plain optimizer; GPU runs shard it)"
            )
        return opt_cfg.model_copy(update={"use_distributed_optimizer": False})
    return opt_cfg


def attach_score_head(
    model: torch.nn.Module, bridge: BridgeConfig, model_path: str, seed: int
) -> BridgeConfig:
    """Turn the loaded causal LM into a reward model (:mod:`.reward_head`) with a fresh head (a
    reward model's folder brings its own: :func:`build_gpt_stage`); returns the bridge
    its checkpoints record: the model as an HF sequence classifier with one label, whose
    ``pad_token_id`` is the tokenizer's (its EOS when it has no pad token)."""
    from transformers import AutoTokenizer

    from nemo_rl.models.policy.workers.megatron.reward_head import (
        attach_reward_head,
        initial_head_weight,
    )

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    std = float(bridge.resolved.get("initializer_range", 0.02))
    attach_reward_head(model, initial_head_weight(model.config.hidden_size, std, seed))
    return bridge.as_sequence_classifier(pad)


def setup_policy_model(
    config: PolicyConfig, model_path: str, seed: int, init_optimizer: bool = True
) -> PolicyModel:
    """Process groups, model stage with HF weights (and LoRA adapters, the rest frozen, with
    ``megatron_cfg.peft``), DDP, optimizer and scheduler for this rank.

    Args:
        config: the validated ``policy`` section.
        model_path: local HF checkpoint folder.
        seed: base seed of megatron's model-parallel RNG tracker.
        init_optimizer: False: a frozen stage (:class:`FrozenStage`) without DDP, optimizer or
            scheduler (a distillation teacher; ``megatron_cfg.optimizer`` is ignored).
    """
    mcfg = config.megatron_cfg
    dtype = dtype_from_name(config.precision)
    layout = init_parallel_from_env(mcfg, seed)
    model, bridge, tconfig = build_gpt_stage(model_path, config, layout, dtype)
    if config.reward_model_cfg.enabled and not bridge.is_sequence_classifier:
        bridge = attach_score_head(model, bridge, model_path, seed)
    lora = add_lora_adapters(model, config, bridge, model_path, seed) if mcfg.peft.enabled else None
    if not init_optimizer:
        return PolicyModel(
            FrozenStage(model), None, None, bridge, layout, dtype, lora, config.logprob_chunk_size,
            config.generation.training_sampling(),
        )
    opt_cfg = effective_optimizer_config(mcfg.optimizer, announce=layout.rank == 0)
    ddp = wrap_ddp(model, tconfig, opt_cfg.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, opt_cfg, dtype)
    scheduler = build_scheduler(optimizer, opt_cfg, mcfg.scheduler)
    return PolicyModel(
        ddp, optimizer, scheduler, bridge, layout, dtype, lora, config.logprob_chunk_size,
        config.generation.training_sampling(),
    )
