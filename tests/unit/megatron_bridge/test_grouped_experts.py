"""Grouped-GEMM experts (:class:`~megatron_bridge.grouped_experts.GroupedGemmExperts`) against
megatron's ``SequentialMLP`` loop: the same checkpoint gives the same logits and the same
gradient for every parameter, on both MoE families (one gloo rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mb_fixtures import sample_input_ids
from megatron_bridge.parallel_state import find_free_port


@pytest.fixture(scope="module")
def one_rank():
    from megatron_bridge.parallel_state import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )

    initialize_megatron_parallel(0, 1, master_port=find_free_port())
    yield
    destroy_megatron_parallel()


def _logits_and_grads(path: Path, grouped: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], type]:
    """Logits [batch, seq, vocab] of the model at ``path`` and each parameter's gradient of
    a fixed random projection of them."""
    from megatron_bridge import BridgeConfig, megatron_logits
    from megatron_bridge.layer_spec import gpt_stage_spec
    from megatron_bridge.load import gpt_model_stage, load_hf_weights

    bridge = BridgeConfig.from_hf(path)
    config = bridge.transformer_config(1, 1, torch.float32)
    model = gpt_model_stage(bridge, config, gpt_stage_spec(config, grouped_experts=grouped), 1)
    load_hf_weights(model, bridge, path)
    ids = sample_input_ids(bridge.vocab_size)
    logits = megatron_logits(model.eval(), ids, bridge.vocab_size)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    out = model(ids, positions, attention_mask=None)
    projection = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * projection).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    experts_class = type(model.decoder.layers[-1].mlp.experts)
    return logits, grads, experts_class


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_grouped_experts_equal_the_loop(one_rank, moe_checkpoints, family):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_bridge.grouped_experts import GroupedGemmExperts

    path = moe_checkpoints[family]
    loop_logits, loop_grads, loop_class = _logits_and_grads(path, grouped=False)
    grouped_logits, grouped_grads, grouped_class = _logits_and_grads(path, grouped=True)
    assert loop_class is SequentialMLP and grouped_class is GroupedGemmExperts
    torch.testing.assert_close(grouped_logits, loop_logits, rtol=0, atol=1e-6)
    assert grouped_grads.keys() == loop_grads.keys()
    expert_grads = [n for n in loop_grads if ".experts.local_experts." in n]
    # most experts receive tokens from the sample (an expert that gets none has a zero gradient)
    assert sum(bool(loop_grads[n].abs().sum() > 0) for n in expert_grads) > len(expert_grads) / 2
    for name, grad in loop_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_grouped_experts_take_experts_without_tokens(one_rank):
    """Experts that receive no token get a zero gradient (not none), as in the loop."""
    from megatron_bridge.grouped_experts import _GroupedLinear

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 16, generator=gen, requires_grad=True)
    weights = [torch.randn(8, 16, generator=gen, requires_grad=True) for _ in range(3)]
    counts = torch.tensor([4, 0, 3])
    y = _GroupedLinear.apply(x, counts.cumsum(0).to(torch.int32), *weights)
    rows = torch.split(x, counts.tolist())
    expected = torch.cat([r @ w.t() for r, w in zip(rows, weights)])
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)
    y.backward(torch.ones_like(y))
    assert torch.equal(weights[1].grad, torch.zeros_like(weights[1]))
    torch.testing.assert_close(weights[0].grad, torch.ones(4, 8).t() @ rows[0])


def test_benchmark_case_runs_and_matches(one_rank):
    """``bench_moe_experts``'s measurement on a small case: both modules timed, outputs and
    gradients bit-identical on CPU in fp32."""
    from benchmarks.bench_moe_experts import Case, run_case

    result = run_case(Case("t", 64, 32, 4, 256), torch.float32, torch.device("cpu"), 1, 1e9)
    assert result["max_relative_difference"] == 0.0
    assert result["loop_ms"] > 0 and result["grouped_ms"] > 0


def test_experts_with_biases_are_refused(one_rank):
    import dataclasses

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from benchmarks.bench_moe_experts import Case, build_experts
    from megatron_bridge.grouped_experts import GroupedGemmExperts

    loop, _ = build_experts(Case("t", 64, 32, 4, 256), torch.float32, torch.device("cpu"))
    config = dataclasses.replace(loop.config, add_bias_linear=True)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(ValueError, match="moe_grouped_gemm=false"):
        GroupedGemmExperts(4, config, submodules, pg_collection=groups)


def test_unaligned_expert_shapes_warn_and_run_the_loop(one_rank):
    """bf16 experts of 20 rows (40 bytes, not a multiple of 16): one warning at construction,
    and the outputs and gradients of megatron's loop."""
    from benchmarks.bench_moe_experts import Case, build_experts, fwd_bwd, max_relative_difference

    case = Case("t", 64, 20, 4, 64)
    with pytest.warns(UserWarning, match="not multiples of 16 bytes"):
        loop, grouped = build_experts(case, torch.bfloat16, torch.device("cpu"))
    assert not grouped.grouped
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(case.rows, case.hidden, generator=gen).bfloat16()
    inputs = (x, torch.tensor([30, 0, 20, 14]), torch.rand(case.rows, generator=gen), torch.ones_like(x))
    assert max_relative_difference(fwd_bwd(loop, *inputs), fwd_bwd(grouped, *inputs)) == 0.0
