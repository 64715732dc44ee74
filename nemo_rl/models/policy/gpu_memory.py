"""The GPU memory plan of a policy config: the numbers :func:`nemo_rl.distributed.memory_plan.
plan_memory` needs, read from ``policy`` and the model's shape.

The model's shape comes from its config.json when that is here without a download (a local
folder, a cached hub snapshot; read as the layout checks read it, through
:class:`~megatron_bridge.BridgeConfig`), else from the published config.json values of the hub
models the shipped recipes train (:data:`~nemo_rl.models.published_configs.PUBLISHED_CONFIGS`);
a hub model in neither place has no plan (nothing is downloaded to make one).
"""

from __future__ import annotations

from megatron_bridge import BridgeConfig, dtype_from_name
from nemo_rl.distributed.memory_plan import (
    GenerationSetup,
    MemoryPlan,
    ModelShape,
    NoMemoryPlan,
    TrainingSetup,
    plan_memory,
)
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.peft import lora_targets
from nemo_rl.models.published_configs import PUBLISHED_CONFIGS
from nemo_rl.models.model_path import local_model_path


def model_bridge(policy: PolicyConfig) -> tuple[BridgeConfig, str] | None:
    """The policy model's config (its vocabulary padded as ``policy.megatron_cfg`` pads it) and
    where it was read: its own config.json, or the published values; None when neither is
    here."""
    divisor = policy.megatron_cfg.make_vocab_size_divisible_by
    path = local_model_path(policy.model_name)
    if path is not None:
        return BridgeConfig.from_hf(path, make_vocab_size_divisible_by=divisor), "its config.json"
    published = PUBLISHED_CONFIGS.get(policy.model_name)
    if published is None:
        return None
    bridge = BridgeConfig(dict(published), make_vocab_size_divisible_by=divisor)
    return bridge, "published config.json values (nemo_rl/models/published_configs.py)"


def model_shape(bridge: BridgeConfig) -> ModelShape:
    """The architecture numbers of the plan from a model's config."""
    dims = bridge.dims(1)
    moe = bridge.is_moe
    return ModelShape(
        num_layers=bridge.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        ffn_hidden_size=dims.ffn,
        vocab_size=dims.vocab_size,
        tie_word_embeddings=bridge.tie_word_embeddings,
        num_experts=dims.num_experts if moe else 0,
        moe_ffn_hidden_size=dims.moe_ffn,
        moe_top_k=int(bridge.resolved["num_experts_per_tok"]) if moe else 0,
        num_moe_layers=sum(bridge.features.sparse_layers),
    )


def adapter_params_per_gpu(
    policy: PolicyConfig, bridge: BridgeConfig, shape: ModelShape, tp: int, pp: int
) -> int | None:
    """LoRA adapter parameters on the GPU of the pipeline stage with the most of them (the
    stages hold consecutive equal runs of layers); None when ``policy`` trains every weight.

    Raises:
        ValueError: a selection the model cannot take (:func:`~nemo_rl.models.policy.peft.
            lora_targets`).
    """
    peft = policy.megatron_cfg.peft
    if not peft.enabled:
        return None
    per_stage = [0] * pp
    for target in lora_targets(peft, bridge, policy.model_name):
        stage = target.layer * pp // shape.num_layers
        per_stage[stage] += shape.adapter_params(target.linear, peft.dim, tp)
    return max(per_stage)


def micro_batch_tokens(policy: PolicyConfig) -> tuple[int, int]:
    """Tokens of one (training, logprob) micro-batch: the token budgets of sequence packing or
    dynamic batching, else samples x ``max_total_sequence_length``."""
    for section in (policy.sequence_packing, policy.dynamic_batching):
        if section.enabled:
            assert section.train_mb_tokens is not None and section.logprob_mb_tokens is not None
            return section.train_mb_tokens, section.logprob_mb_tokens
    seq = policy.max_total_sequence_length
    return policy.train_micro_batch_size * seq, policy.logprob_batch_size * seq


def plan_policy_memory(
    policy: PolicyConfig, world_size: int, gpu_memory_gb: float, with_generation: bool
) -> MemoryPlan | NoMemoryPlan:
    """The per-GPU memory plan of ``policy`` trained on ``world_size`` GPUs of
    ``gpu_memory_gb`` GiB each.

    Args:
        with_generation: the run generates with vLLM (``policy.generation``) and computes
            logprobs (GRPO); False for a supervised run (its training phase only).
    """
    found = model_bridge(policy)
    if found is None:
        return NoMemoryPlan(
            f"the shape of {policy.model_name!r} is unknown here: its config.json is not here "
            "(a hub model not yet downloaded) and nemo_rl/models/published_configs.py does not "
            "list it; download its config.json (`huggingface-cli download "
            f"{policy.model_name} config.json`) to see the plan"
        )
    bridge, source = found
    mcfg = policy.megatron_cfg
    tp = mcfg.tensor_model_parallel_size
    train_tokens, logprob_tokens = micro_batch_tokens(policy)
    shape = model_shape(bridge)
    pp = mcfg.pipeline_model_parallel_size
    training = TrainingSetup(
        world_size=world_size,
        tp=tp,
        pp=pp,
        cp=mcfg.context_parallel_size,
        ep=mcfg.expert_model_parallel_size,
        sequence_parallel=mcfg.sequence_parallel,
        activation_checkpointing=mcfg.activation_checkpointing,
        param_bytes=dtype_from_name(policy.precision).itemsize,
        distributed_optimizer=mcfg.optimizer.use_distributed_optimizer,
        optimizer_moments=2 if mcfg.optimizer.optimizer == "adam" else 1,
        micro_batch_tokens=train_tokens,
        logprob_micro_batch_tokens=logprob_tokens if with_generation else None,
        padded_vocab_size=bridge.padded_vocab(tp),
        logprob_chunk_size=policy.logprob_chunk_size,
        adapter_params=adapter_params_per_gpu(policy, bridge, shape, tp, pp),
    )
    generation = None
    if with_generation:
        vllm = policy.generation.vllm_cfg
        generation = GenerationSetup(
            tensor_parallel_size=vllm.tensor_parallel_size,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            weight_bytes=dtype_from_name(vllm.precision).itemsize,
            colocated=policy.generation.colocated.enabled,
            # None: vLLM takes the model's own limit, which may need a larger KV cache
            max_model_len=vllm.max_model_len or policy.max_total_sequence_length,
        )
    return plan_memory(
        shape,
        f"{policy.model_name} (shape from {source})",
        training,
        generation,
        refit_bucket_bytes=policy.refit_settings().bucket_bytes,
        gpu_bytes=int(gpu_memory_gb * 1024**3),
    )
