"""One MoE layer's experts, forward + backward: grouped GEMMs against megatron's loop.

:class:`~megatron_bridge.grouped_experts.GroupedGemmExperts` (``moe_grouped_gemm: true``, two
``torch._grouped_mm`` per direction) against megatron-core's ``SequentialMLP`` (a loop of two
matmuls per local expert), the same weights and tokens, after the token dispatcher: the input
is already sorted by expert. Each case prints both times, the ratio loop / grouped, and the
fraction of the measured matmul peak (``torch.mm`` of 8192 x 8192 in the case's dtype) the
grouped experts reach by their FLOPs (``18 x rows x hidden x ffn``: fc1 of 2 x ffn outputs and
fc2, forward and two backward products each). It also checks that both give the same output
and gradients (max difference relative to the largest entry).

Default cases, Qwen3-30B-A3B's layer (hidden 2048, expert ffn 768, 128 experts, top-8) for
an 8192-token micro-batch (65,536 routed rows): all 128 experts on one rank (EP=1) and 16
(EP=8); the rows per expert are drawn from a skewed distribution (some experts get several
times the mean, some none).

    PYTHONPATH=. python benchmarks/bench_moe_experts.py --device cuda          # bf16, Qwen3-30B-A3B
    PYTHONPATH=. python benchmarks/bench_moe_experts.py --device cpu --small   # fp32, small sizes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks.bench_megatron_worker_train import matmul_peak_flops
from benchmarks.memcpy_baseline import synchronize


@dataclass(frozen=True)
class Case:
    """One layer's local experts and the rows routed to them."""

    name: str
    hidden: int
    ffn: int  # each expert's intermediate size (fc1 has 2 x ffn outputs: gate and up)
    local_experts: int
    rows: int  # routed (token, expert) pairs that reach this rank

    def flops(self) -> float:
        """Forward + backward FLOPs of both products over all rows."""
        return 18.0 * self.rows * self.hidden * self.ffn


QWEN3_30B_A3B = [
    Case("qwen3-30b-a3b EP=1 (128 local experts)", 2048, 768, 128, 65536),
    Case("qwen3-30b-a3b EP=8 (16 local experts)", 2048, 768, 16, 65536),
]
SMALL = [
    Case("small, 32 local experts", 256, 128, 32, 4096),
    Case("small, 8 local experts", 256, 128, 8, 4096),
]


def build_experts(case: Case, dtype: torch.dtype, device: torch.device) -> tuple:
    """``(loop, grouped)``: a ``SequentialMLP`` and a ``GroupedGemmExperts`` of ``case`` holding
    the same random weights. Needs megatron's parallel state (one rank)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_bridge.grouped_experts import GroupedGemmExperts

    config = TransformerConfig(
        num_layers=1,
        hidden_size=case.hidden,
        num_attention_heads=8,
        ffn_hidden_size=case.ffn,
        moe_ffn_hidden_size=case.ffn,
        num_moe_experts=case.local_experts,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=device.type == "cuda",
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
    )
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    loop = SequentialMLP(case.local_experts, config, submodules, pg_collection=groups)
    grouped = GroupedGemmExperts(case.local_experts, config, submodules, pg_collection=groups)
    grouped.load_state_dict(loop.state_dict())
    return loop.to(device), grouped.to(device)


def routed_rows(case: Case, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Rows per local expert [local_experts], skewed: expert shares ~ Gamma(0.5)."""
    gen = torch.Generator().manual_seed(seed)
    shares = torch.distributions.Gamma(0.5, 1.0).sample((case.local_experts,))
    counts = torch.multinomial(shares / shares.sum(), case.rows, replacement=True, generator=gen)
    return torch.bincount(counts, minlength=case.local_experts).to(device)


def fwd_bwd(experts, x, tokens_per_expert, probs, grad) -> tuple[torch.Tensor, ...]:
    """One forward and backward; returns the output and the gradients (input, probs, params)."""
    for p in experts.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    out, _ = experts(x, tokens_per_expert, probs)
    out.backward(grad)
    return (out, x.grad, probs.grad, *(p.grad for p in experts.parameters()))


def max_relative_difference(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """Largest |a - b| of any tensor pair, relative to that pair's largest |a|."""
    return max(
        float((x.float() - y.float()).abs().max() / x.float().abs().max().clamp_min(1e-30))
        for x, y in zip(a, b)
    )


def time_fwd_bwd(experts, inputs, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fwd_bwd`` over ``repeats`` after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        fwd_bwd(experts, *inputs)
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(case: Case, dtype: torch.dtype, device: torch.device, repeats: int, peak: float) -> dict:
    loop, grouped = build_experts(case, dtype, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case.rows, case.hidden, generator=gen).to(device, dtype)
    probs = torch.rand(case.rows, generator=gen).to(device, torch.float32)
    grad = torch.randn(case.rows, case.hidden, generator=gen).to(device, dtype)
    inputs = (x, routed_rows(case, device), probs, grad)
    difference = max_relative_difference(fwd_bwd(loop, *inputs), fwd_bwd(grouped, *inputs))
    loop_s = time_fwd_bwd(loop, inputs, device, repeats)
    grouped_s = time_fwd_bwd(grouped, inputs, device, repeats)
    return dict(
        **asdict(case),
        dtype=str(dtype).removeprefix("torch."),
        loop_ms=loop_s * 1e3,
        grouped_ms=grouped_s * 1e3,
        loop_over_grouped=loop_s / grouped_s,
        grouped_fraction_of_peak=case.flops() / grouped_s / peak,
        loop_fraction_of_peak=case.flops() / loop_s / peak,
        max_relative_difference=difference,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (the CPU's cases)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bf16 on cuda")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from megatron_bridge.parallel_state import (
        destroy_megatron_parallel,
        find_free_port,
        initialize_megatron_parallel,
    )

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cuda":
        torch.cuda.set_device(0)
    initialize_megatron_parallel(0, 1, master_port=find_free_port())
    try:
        n = 8192 if device.type == "cuda" else 2048
        peak = matmul_peak_flops(n, device=args.device, dtype=str(dtype).removeprefix("torch."))
        print(f"matmul peak ({n}^3 {dtype}): {peak / 1e12:.2f} TFLOP/s")
        cases = SMALL if args.small or device.type == "cpu" else QWEN3_30B_A3B
        results = []
        for case in cases:
            r = run_case(case, dtype, device, args.repeats, peak)
            results.append(r)
            print(
                f"{case.name}: loop {r['loop_ms']:.2f} ms, grouped {r['grouped_ms']:.2f} ms, "
                f"loop/grouped {r['loop_over_grouped']:.2f}x; grouped at "
                f"{r['grouped_fraction_of_peak']:.0%} of peak (loop {r['loop_fraction_of_peak']:.0%}); "
                f"max relative difference {r['max_relative_difference']:.1e}"
            )
    finally:
        destroy_megatron_parallel()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(peak_flops=peak, device=args.device, results=results), f, indent=1)


if __name__ == "__main__":
    main()
