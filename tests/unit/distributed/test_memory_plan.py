"""The per-GPU memory plan's formulas against hand computations on a small model, and the
refusal of a plan that does not fit."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_rl.distributed.memory_plan import (
    ACTIVATIONS,
    ASLEEP_ENGINE_BYTES,
    ENGINE_ASLEEP,
    ENGINE_WEIGHTS,
    GENERATION,
    GRADIENTS,
    KV_CACHE,
    LOGITS,
    LOGPROBS,
    OPTIMIZER,
    PARAMETERS,
    REFIT,
    REFIT_RING,
    RUNTIME,
    RUNTIME_ALLOWANCE_BYTES,
    TRAINING,
    GenerationSetup,
    GiB,
    MemoryPlanError,
    ModelShape,
    NoMemoryPlan,
    TrainingSetup,
    plan_memory,
    refit_staging_bytes,
)

MiB = 2**20

# 2 layers, hidden 64, 4 query heads / 2 KV heads of 16, FFN 128, 1000-token vocabulary, untied.
# Per layer: attention 2*64*64 + 2*64*32 = 12288, MLP 3*64*128 = 24576 -> 36864; two layers
# 73728; embedding and LM head 2 * 1000 * 64 = 128000; in all 201728.
DENSE = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
    ffn_hidden_size=128, vocab_size=1000, tie_word_embeddings=False,
)
# 4 GPUs, TP 2 -> DP 2; vocabulary padded to a multiple of 128 x TP = 256: 1024 rows.
TRAIN = TrainingSetup(
    world_size=4, tp=2, pp=1, cp=1, ep=1, sequence_parallel=False,
    activation_checkpointing=False, param_bytes=2, distributed_optimizer=True,
    optimizer_moments=2, micro_batch_tokens=256, logprob_micro_batch_tokens=512,
    padded_vocab_size=1024,
)
ENGINE = GenerationSetup(
    tensor_parallel_size=1, gpu_memory_utilization=0.5, weight_bytes=2, colocated=True,
    max_model_len=128,
)


def terms(plan, phase: str) -> dict[str, int]:
    return {t.name: t.nbytes for t in plan.phase(phase).terms}


def test_refit_staging_is_slots_of_the_larger_of_bucket_and_tensor() -> None:
    assert refit_staging_bytes(256 * MiB, GiB) == 2 * GiB
    assert refit_staging_bytes(GiB, 100) == 2 * GiB
    assert refit_staging_bytes(MiB, 3 * MiB, slots=3) == 9 * MiB


def test_model_shape_counts_parameters_and_the_largest_stream_tensor() -> None:
    assert DENSE.total_params == 201728
    # the embedding [1000, 64] is larger than any projection ([128, 64], [64, 64])
    assert DENSE.largest_stream_elements() == 64000


def test_colocated_plan_of_a_small_dense_model_by_hand() -> None:
    plan = plan_memory(DENSE, "small", TRAIN, ENGINE, refit_bucket_bytes=MiB, gpu_bytes=8 * GiB)
    # Per GPU: layers 73728 / TP 2 = 36864, embedding and head 2 * 1024 * 64 / 2 = 65536.
    params = 36864 + 65536
    # Activations per token and layer (no SP, no recompute): attention 2*64 + (4 + 4)*16/2 +
    # 4*16/2 = 224, MLP 2*64 + 3*128/2 = 320 -> 544; 2 layers, 256 tokens, 2 B.
    activations = 256 * 2 * 544 * 2
    assert terms(plan, TRAINING) == {
        PARAMETERS: params * 2,
        GRADIENTS: params * 4,
        OPTIMIZER: params * 12 // 2,  # fp32 master + 2 moments over DP 2
        ACTIVATIONS: activations,
        LOGITS: 256 * 512 * 4,  # [256 tokens, 1024 / TP 2] fp32
        RUNTIME: RUNTIME_ALLOWANCE_BYTES,
        ENGINE_ASLEEP: ASLEEP_ENGINE_BYTES,
    }
    # One layer's forward activations of the 512-token logprob micro-batch, and its logits.
    assert terms(plan, LOGPROBS)[ACTIVATIONS] == 512 * 544 * 2
    assert terms(plan, LOGPROBS)[LOGITS] == 512 * 512 * 4
    engine_weights = 201728 * 2
    budget = 4 * GiB  # 0.5 x 8 GiB
    assert terms(plan, REFIT) == {
        ENGINE_WEIGHTS: engine_weights,
        KV_CACHE: budget - engine_weights,
        PARAMETERS: params * 2,
        REFIT_RING: 2 * MiB,  # the embedding (128000 B) is smaller than a bucket
        RUNTIME: RUNTIME_ALLOWANCE_BYTES,
    }
    assert terms(plan, GENERATION) == {
        ENGINE_WEIGHTS: engine_weights, KV_CACHE: budget - engine_weights,
        RUNTIME: RUNTIME_ALLOWANCE_BYTES,
    }
    assert plan.peak().name == REFIT
    assert plan.phase(REFIT).total == 6 * GiB + params * 2 + 2 * MiB
    # KV per token: 2 (K, V) x 2 layers x 2 heads x 16 x 2 B = 256 B
    assert f"at most {(budget - engine_weights) // 256:,} tokens per engine" in plan.notes[0]
    plan.check()


def test_recompute_and_sequence_parallel_keep_layer_inputs_split_over_tp() -> None:
    setup = dataclasses.replace(TRAIN, activation_checkpointing=True, sequence_parallel=True)
    plan = plan_memory(DENSE, "small", setup, ENGINE, MiB, 8 * GiB)
    # Each layer keeps its input, 64 / TP 2 = 32 per token: 2 x 32; one layer recomputed whole:
    # attention 2*32 + 64 + 32 = 160, MLP 2*32 + 192 = 256.
    assert terms(plan, TRAINING)[ACTIVATIONS] == 256 * (2 * 32 + 160 + 256) * 2


def test_pipeline_stage_holds_its_layers_and_one_vocabulary_matrix() -> None:
    setup = dataclasses.replace(TRAIN, world_size=8, pp=2)
    plan = plan_memory(DENSE, "small", setup, ENGINE, MiB, 8 * GiB)
    params = 73728 // (2 * 2) + 1024 * 64 // 2
    assert terms(plan, TRAINING)[PARAMETERS] == params * 2
    assert terms(plan, TRAINING)[OPTIMIZER] == params * 12 // 2  # DP = 8 / (TP 2 x PP 2)
    # 1F1B: the first stage keeps its 1 layer for 2 micro-batches in flight.
    assert terms(plan, TRAINING)[ACTIVATIONS] == 256 * 1 * 2 * 544 * 2


def test_lora_adapter_shapes_split_over_tp_as_their_linears() -> None:
    # rank 8; q 64, kv 32 each, f 128, h 64; TP 2 splits B's rows (column) or A's columns (row).
    assert DENSE.adapter_params("linear_qkv", 8, 2) == 8 * 64 + 8 * 128 // 2
    assert DENSE.adapter_params("linear_proj", 8, 2) == 8 * 64 // 2 + 8 * 64
    assert DENSE.adapter_params("linear_fc1", 8, 2) == 8 * 64 + 8 * 256 // 2
    assert DENSE.adapter_params("linear_fc2", 8, 2) == 8 * 128 // 2 + 8 * 64


def test_lora_gradients_and_optimizer_cover_the_adapters_only() -> None:
    adapters = 1000
    setup = dataclasses.replace(TRAIN, adapter_params=adapters)
    plan = plan_memory(DENSE, "small", setup, ENGINE, MiB, 8 * GiB)
    base = 36864 + 65536  # as in the full plan: frozen, but resident
    got = terms(plan, TRAINING)
    assert got[PARAMETERS] == (base + adapters) * 2
    assert got[GRADIENTS] == adapters * 4
    assert got[OPTIMIZER] == adapters * 12 // 2  # fp32 master + 2 moments over DP 2
    assert "LoRA adapters only / DP 2" in plan.term(TRAINING, OPTIMIZER).detail
    assert terms(plan, REFIT)[PARAMETERS] == (base + adapters) * 2


def test_experts_split_over_ep_and_their_optimizer_over_expert_dp() -> None:
    moe = dataclasses.replace(
        DENSE, num_experts=4, moe_ffn_hidden_size=32, moe_top_k=2, num_moe_layers=2
    )
    setup = dataclasses.replace(TRAIN, world_size=8, ep=2)  # DP 4, experts' DP 8 / (2*2) = 2
    plan = plan_memory(moe, "moe", setup, None, MiB, 8 * GiB)
    # Dense: attention 2 x 12288 + routers 2 x 64 x 4 = 25088 / TP 2 + vocabulary 65536;
    # experts 2 layers x 4 x 3 x 64 x 32 = 49152 / (TP 2 x EP 2).
    dense, experts = 25088 // 2 + 65536, 49152 // 4
    # Per token and layer: attention 224, experts 2*64 + top-2 x (2*64 + 3*32/2) = 480.
    assert terms(plan, TRAINING) == {
        PARAMETERS: (dense + experts) * 2,
        GRADIENTS: (dense + experts) * 4,
        OPTIMIZER: dense * 12 // 4 + experts * 12 // 2,
        ACTIVATIONS: 256 * 2 * (224 + 480) * 2,
        LOGITS: 256 * 512 * 4,
        RUNTIME: RUNTIME_ALLOWANCE_BYTES,
    }
    assert [p.name for p in plan.phases] == [TRAINING]  # no engines: a supervised run
    assert moe.largest_stream_elements() == 64000  # stacked experts [4, 64, 64] are smaller


def test_fp32_parameters_need_no_master_copy_and_sgd_one_moment() -> None:
    setup = dataclasses.replace(TRAIN, param_bytes=4, optimizer_moments=1,
                                distributed_optimizer=False)
    plan = plan_memory(DENSE, "small", setup, None, MiB, 8 * GiB)
    assert terms(plan, TRAINING)[OPTIMIZER] == (36864 + 65536) * 4


def test_not_colocated_engines_have_gpus_of_their_own_with_the_ring() -> None:
    engine = dataclasses.replace(ENGINE, colocated=False, gpu_memory_utilization=0.9)
    plan = plan_memory(DENSE, "small", TRAIN, engine, MiB, 8 * GiB)
    assert {p.name: p.gpus for p in plan.phases} == {
        TRAINING: "policy GPUs", LOGPROBS: "policy GPUs", REFIT: "policy GPUs",
        GENERATION: "generation GPUs",
    }
    assert ENGINE_ASLEEP not in terms(plan, TRAINING)
    assert set(terms(plan, REFIT)) == {PARAMETERS, GRADIENTS, OPTIMIZER, REFIT_RING, RUNTIME}
    assert terms(plan, GENERATION) == {
        ENGINE_WEIGHTS: 201728 * 2,
        KV_CACHE: int(0.9 * 8 * GiB) - 201728 * 2,
        REFIT_RING: 2 * MiB,
    }


def test_a_plan_over_the_gpu_names_its_largest_term_and_the_fix() -> None:
    # 4M tokens per micro-batch without recompute: 4Mi x 2 layers x 544 x 2 B = 8.5 GiB of
    # activations, 4Mi x 512 x 4 B = 8 GiB of logits, 2 GiB of allowance, on a 4 GiB GPU.
    setup = dataclasses.replace(TRAIN, micro_batch_tokens=4 * 2**20)
    plan = plan_memory(DENSE, "small", setup, None, MiB, 4 * GiB)
    with pytest.raises(MemoryPlanError) as err:
        plan.check()
    message = str(err.value)
    assert message.startswith(
        "the GPU memory plan does not fit: the training phase needs 18.5 GiB per GPU (every "
        "GPU), more than cluster.gpu_memory_gb = 4.0 GiB; its largest term is activations = "
        "8.5 GiB (4194304 tokens per micro-batch, no recompute: 2/1 layers x 1 micro-batch(es) "
        "in flight, 2 B per element): set policy.megatron_cfg.activation_checkpointing=true"
    )
    assert "Peak: training (every GPU), 18.5 of 4.0 GiB (463%): DOES NOT FIT" in message


def test_engine_weights_beyond_the_budget_and_a_kv_cache_without_one_sequence() -> None:
    tight = dataclasses.replace(ENGINE, gpu_memory_utilization=0.00001)  # 84 KiB of 8 GiB
    with pytest.raises(MemoryPlanError, match="the vLLM engine's weights, 0.0 GiB per GPU .* "
                       "exceed its budget"):
        plan_memory(DENSE, "small", TRAIN, tight, MiB, 8 * GiB).check()
    # 4096 tokens of 256 B fit in 1 MiB beside the 394 KiB of weights: max_model_len 8192 not.
    long = dataclasses.replace(ENGINE, gpu_memory_utilization=(1.4 * MiB) / (8 * GiB),
                               max_model_len=8192)
    with pytest.raises(MemoryPlanError, match="fewer than one sequence of policy.generation."
                       "vllm_cfg.max_model_len = 8192"):
        plan_memory(DENSE, "small", TRAIN, long, MiB, 8 * GiB).check()


def test_format_shows_the_table_peak_and_formulas() -> None:
    text = plan_memory(DENSE, "small", TRAIN, ENGINE, MiB, 8 * GiB).format()
    lines = text.splitlines()
    assert lines[0] == "GPU memory plan of small:"
    assert lines[1].split() == ["GiB", "per", "GPU", "training", "logprobs", "refit", "generation"]
    assert lines[2].split() == ["policy", "parameters", "0.0", "0.0", "0.0", "-"]
    assert "  Peak: refit (every GPU), 6.0 of 8.0 GiB (75%): fits" in lines
    assert "    refit ring: 2 x max(bucket 0.0 GiB, largest tensor 0.0 GiB)" in lines
    assert NoMemoryPlan("a CPU run").format() == "GPU memory plan: none (a CPU run)"
