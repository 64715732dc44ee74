"""``nemo-rl eval --config RECIPE``: sample k responses per prompt, judge them, score them.

The model (``generation.model_name``: a hub name, an HF folder, a tiny model, or a training
checkpoint, exported to a temporary HF folder first with :func:`~nemo_rl.models.policy.export.
export_checkpoint`) is served by vLLM engines; the prompts are the data's validation split,
each repeated ``eval.num_tests_per_prompt`` times, and are rolled out and judged exactly as a
GRPO validation does (:func:`~nemo_rl.experience.grouped_rollouts.repeat_prompts`, then
:func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` against the task's environment
actors). The prompts are rendered as training renders the same rows. ``generation.temperature:
0`` is argmax decoding. Scores: :mod:`nemo_rl.evals.metrics` (maj@k only when every evaluated
task's environment returns the answers it extracts). Prompts that leave fewer than
``generation.max_new_tokens`` tokens under ``generation.vllm_cfg.max_model_len`` cost one
warning with the numbers; responses cut at a token limit are counted (``num_truncated``).
With ``eval.save_path`` the run writes ``samples.jsonl`` (one line per sample: prompt index,
sample index, prompt and its token ids, response with its token ids and the engine's logprobs,
later turns, extracted answer, ground truth, reward, passed, truncated), ``summary.json`` and
``config.yaml`` there.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from nemo_rl.evals.config import EvalMasterConfig, check_tasks_return_answers
from nemo_rl.evals.metrics import summarize
from nemo_rl.utils.config import ConfigError, config_to_yaml

logger = logging.getLogger(__name__)


def resolve_eval_model(model_name: str, workdir: Path) -> str:
    """A local HF folder for ``model_name``: a training checkpoint (a folder without
    ``config.json``) is exported into ``workdir``; anything else resolves like
    ``policy.model_name``.

    Raises:
        ConfigError: the checkpoint cannot be exported, or the model is not found.
    """
    from megatron_bridge.cli import CliError
    from nemo_rl.models.policy.export import export_checkpoint
    from nemo_rl.models.model_path import resolve_model_path

    path = Path(model_name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        try:
            policy_dir = export_checkpoint(path, workdir / "hf")
        except CliError as err:
            raise ConfigError(f"generation.model_name={model_name!r}: {err}") from err
        print(f"evaluating training checkpoint {policy_dir} (exported to HF)")
        return str(workdir / "hf")
    try:
        return resolve_model_path(model_name)
    except (OSError, ValueError) as err:
        raise ConfigError(f"generation.model_name={model_name!r}: {err}") from err


def prompt_batches(cfg: EvalMasterConfig, tokenizer: Any) -> list[Any]:
    """The validation prompts, collated ``eval.num_prompts_per_step`` at a time.

    Raises:
        ConfigError: no validation split; maj@k asked of a task that returns no answers.
    """
    from nemo_rl.data.datasets import setup_datasets
    from nemo_rl.data.llm_message_utils import rl_collate_fn

    specs = cfg.env.specs()
    _, val, _ = setup_datasets(cfg.data, tokenizer, specs)
    if val is None or len(val) == 0:
        raise ConfigError(
            "the data has no validation split to evaluate: set data.val_path, or "
            "data.val_split for an HF dataset"
        )
    count = len(val) if cfg.eval.max_num_prompts is None else min(len(val), cfg.eval.max_num_prompts)
    rows = [val[i] for i in range(count)]
    if cfg.eval.votes:
        check_tasks_return_answers(cfg.eval.metric, [r["task_name"] for r in rows], specs)
    size = count if cfg.eval.num_prompts_per_step == -1 else cfg.eval.num_prompts_per_step
    return [rl_collate_fn(rows[i : i + size]) for i in range(0, count, size)]


def check_generation_room(batches: list[Any], max_new_tokens: int, max_model_len: int) -> None:
    """Warn once when some prompts leave fewer than ``max_new_tokens`` tokens under
    ``max_model_len`` (their responses stop early, counted in ``num_truncated``).

    Raises:
        ConfigError: a prompt leaves no room at all.
    """
    lengths = [int(n) for batch in batches for n in batch["length"]]
    longest = max(lengths)
    if longest >= max_model_len:
        raise ConfigError(
            f"a prompt has {longest} tokens, not below generation.vllm_cfg.max_model_len="
            f"{max_model_len}: nothing can be generated after it; raise max_model_len above "
            f"{longest} or shorten the prompts"
        )
    short = sum(n + max_new_tokens > max_model_len for n in lengths)
    if short:
        logger.warning(
            "%d of %d prompts leave fewer than generation.max_new_tokens=%d tokens under "
            "generation.vllm_cfg.max_model_len=%d (the longest has %d tokens: its responses "
            "stop after %d); such responses are cut there and counted in num_truncated. Raise "
            "max_model_len to %d to give every response its max_new_tokens",
            short, len(lengths), max_new_tokens, max_model_len, longest,
            max_model_len - longest, longest + max_new_tokens,
        )


def _turn(message: dict[str, Any]) -> dict[str, Any]:
    """A later message of a sample's conversation as JSON: role, text, token ids (and the
    engine's logprobs of an assistant turn)."""
    turn = {"role": message["role"], "content": message["content"],
            "token_ids": message["token_ids"].tolist()}
    if "generation_logprobs" in message:
        turn["logprobs"] = message["generation_logprobs"].tolist()
    return turn


def sample_records(
    prompts: Any, rollout: Any, num_tests: int, threshold: float
) -> list[dict[str, Any]]:
    """One JSON-ready record per rolled-out sample of ``prompts`` (rows repeated
    ``num_tests`` times in a row, as :func:`repeat_prompts` lays them out): the prompt (text
    and token ids), the first response (text, ``response_token_ids``, ``response_logprobs``:
    the engine's logprob of each of them), the later turns, the environment's answer, the
    ground truth, the reward, ``passed`` and ``truncated`` (the last response stopped at a
    token limit)."""
    import torch

    records = []
    for row, log in enumerate(rollout["message_log"]):
        prompt_row = row // num_tests
        prompt_log = prompts["message_log"][prompt_row]
        later = [_turn(m) for m in log[len(prompt_log) :]]
        first = later[0] if later else {"content": "", "token_ids": []}
        reward = float(rollout["total_reward"][row])
        info = prompts["extra_env_info"][prompt_row] or {}
        records.append({
            "prompt_index": int(prompts["idx"][prompt_row]),
            "sample": row % num_tests,
            "task_name": prompts["task_name"][prompt_row],
            "prompt": "".join(m["content"] for m in prompt_log),
            "prompt_token_ids": torch.cat([m["token_ids"] for m in prompt_log]).tolist(),
            "response": first["content"],
            "response_token_ids": first["token_ids"],
            "response_logprobs": first.get("logprobs"),
            "later_turns": later[1:],
            "answer": rollout["answers"][row],
            "ground_truth": info.get("ground_truth"),
            "reward": reward,
            "passed": reward >= threshold,
            "truncated": bool(rollout["response_truncated"][row]),
        })
    return records


def score_records(records: list[dict[str, Any]], k: int, vote: bool = True) -> dict[str, float]:
    """:func:`~nemo_rl.evals.metrics.summarize` over records grouped by prompt (in order),
    plus ``num_truncated``; ``vote``: score maj@k (the tasks return answers)."""
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_prompt.setdefault(record["prompt_index"], []).append(record)
    groups = list(by_prompt.values())
    scores = summarize(
        [[r["passed"] for r in g] for g in groups],
        [[r["answer"] for r in g] for g in groups] if vote else None,
        [[r["reward"] for r in g] for g in groups],
        k,
    )
    scores["num_truncated"] = float(sum(r["truncated"] for r in records))
    return scores


def evaluate(cfg: EvalMasterConfig, model_path: str) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Roll out and judge every validation prompt ``num_tests_per_prompt`` times on engines
    serving ``model_path`` (starts and stops its own Ray actors; Ray must be up).

    Returns:
        ``(records, scores)``: :func:`sample_records` of every sample, and the scores.
    """
    from transformers import AutoTokenizer

    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.environments.utils import create_environments, shutdown_environments
    from nemo_rl.experience.grouped_rollouts import repeat_prompts
    from nemo_rl.experience.async_engine_rollouts import multi_turn_rollout_for
    from nemo_rl.models.generation.vllm.async_generation import vllm_generation

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = prompt_batches(cfg, tokenizer)
    max_model_len = int(cfg.generation.vllm_cfg.max_model_len)
    check_generation_room(batches, cfg.generation.max_new_tokens, max_model_len)
    specs = cfg.env.specs()
    vote = all(specs[task].returns_answers for batch in batches for task in batch["task_name"])
    c, n = cfg.cluster, cfg.eval.num_tests_per_prompt
    per_node = c.gpus_per_node or c.cpu_bundles_per_node
    cpus = (c.cpus_per_node - cfg.env.total_cpus) / per_node
    if cpus <= 0:
        raise ConfigError(
            f"cluster.cpus_per_node={c.cpus_per_node} leaves no CPUs for the engines next to "
            f"the environments ({cfg.env.total_cpus:g} CPUs); raise it or lower env.*.num_cpus"
        )
    cluster = RayVirtualCluster([per_node] * c.num_nodes, c.gpus_per_node > 0, cpus,
                                name="generation")
    task_to_env = create_environments(cfg.env)
    generation = None
    try:
        generation = vllm_generation(
            cluster, cfg.generation, model_path, pad_token_id=pad, seed=cfg.eval.seed
        )
        generation.prepare_for_generation()
        records: list[dict[str, Any]] = []
        for prompts in batches:
            repeated, _ = repeat_prompts(prompts, n)
            rollout, _ = multi_turn_rollout_for(generation)(
                generation,
                repeated,
                tokenizer,
                task_to_env,
                max_seq_len=max_model_len,
                max_rollout_turns=cfg.eval.max_rollout_turns,
                greedy=cfg.generation.temperature == 0,
            )
            records += sample_records(prompts, rollout, n, cfg.eval.pass_threshold)
        generation.finish_generation()
    finally:
        if generation is not None:
            generation.shutdown()
        shutdown_environments(task_to_env)
        cluster.shutdown()
    return records, score_records(records, cfg.eval.k_value, vote)


def format_summary(scores: dict[str, float], cfg: EvalMasterConfig) -> str:
    """The summary table: one line per score, the headline (``eval.metric``) marked."""
    k = cfg.eval.k_value
    headline = f"pass@{k}" if cfg.eval.metric == "pass@k" else f"maj@{k}"
    lines = [f"evaluation of {cfg.generation.model_name}  ({int(scores['num_prompts'])} prompts "
             f"x {cfg.eval.num_tests_per_prompt} samples, temperature "
             f"{cfg.generation.temperature:g})"]
    width = max(len(name) for name in [*scores, f"maj@{k}"])
    for name, value in scores.items():
        shown = f"{int(value)}" if name.startswith("num_") else f"{value:.4f}"
        lines.append(f"  {name:<{width}}  {shown}{'   <- eval.metric' if name == headline else ''}")
    if f"maj@{k}" not in scores:
        lines.append(f"  {f'maj@{k}':<{width}}  not scored: a task's environment returns no "
                     "answers to vote over (a reward_fn task: set its answer_fn)")
    return "\n".join(lines)


def save_results(path: Path, cfg: EvalMasterConfig, records: list[dict[str, Any]],
                 scores: dict[str, float]) -> None:
    """``samples.jsonl``, ``summary.json`` and ``config.yaml`` into folder ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "samples.jsonl", "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    (path / "summary.json").write_text(json.dumps(scores, indent=2) + "\n")
    (path / "config.yaml").write_text(config_to_yaml(cfg))


def run_eval(cfg: EvalMasterConfig) -> dict[str, float]:
    """Resolve (or export) the model, start Ray (or join ``RAY_ADDRESS``'s), evaluate, print
    the summary and save the results; returns the scores."""
    from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray

    with tempfile.TemporaryDirectory(prefix="nemo_rl_eval_") as workdir:
        model_path = resolve_eval_model(cfg.generation.model_name, Path(workdir))
        local_cpus = cfg.cluster.cpus_per_node if cfg.cluster.gpus_per_node == 0 else None
        init_ray(num_cpus=None if os.environ.get("RAY_ADDRESS") else local_cpus)
        try:
            records, scores = evaluate(cfg, model_path)
        finally:
            shutdown_ray()
    print(format_summary(scores, cfg))
    if cfg.eval.save_path is not None:
        save_results(Path(cfg.eval.save_path), cfg, records, scores)
        print(f"samples and summary: {cfg.eval.save_path}")
    return scores


def run(cfg: EvalMasterConfig) -> None:
    """``nemo-rl eval``: :func:`run_eval`."""
    run_eval(cfg)
