"""Rollouts: the policy generates, environments answer, until every sample is done.

A batch of samples (``DatumSpec`` rows: ``message_log``, ``extra_env_info``, ``task_name``,
optional ``stop_strings``) goes through turns. Each turn the active samples' conversations are
flattened into prompts, the generation backend answers each with one assistant message (its
token ids and the engine's logprobs are kept with the message), and each sample's environment
(``task_to_env[task_name]``, a Ray actor) judges it. A sample leaves the active set when its
environment ends the episode, when its conversation reaches ``max_seq_len`` tokens (truncated;
the environment still judges the response cut to fit), or after ``max_rollout_turns``. A turn
that stops at ``max_new_tokens`` does not end the episode: the environment judges it. Observations of samples that go on are tokenized and appended as
messages, and the environment's stop strings apply to the sample's next turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nemo_rl.data.interfaces import LLMMessageLogType, Message
from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.data.processors import message_log_length
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.common import split_rewards
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.environments.utils import safe_env_step
from nemo_rl.models.generation.interfaces import GenerationInterface

# Seconds an environment may take for one step of its samples before they score 0.
ENV_STEP_TIMEOUT_S = 300.0


def generation_input(
    message_logs: list[LLMMessageLogType],
    stop_strings: list[Optional[list[str]]],
    pad_token_id: int,
) -> BatchedDataDict:
    """Right-padded prompts ``input_ids`` ``[B, S]``, ``input_lengths`` ``[B]`` and per-sample
    ``stop_strings`` of the conversations so far."""
    flat = message_logs_to_flat(message_logs, pad_token_id)
    return BatchedDataDict(
        input_ids=flat["input_ids"],
        input_lengths=flat["input_lengths"],
        stop_strings=list(stop_strings),
    )


def generate_responses(
    policy_generation: GenerationInterface,
    generation_input_data: BatchedDataDict,
    batch: BatchedDataDict,
    tokenizer: Any,
    input_lengths: torch.Tensor,
    include_logprobs: bool = True,
    greedy: bool = False,
) -> tuple[BatchedDataDict, list[torch.Tensor], dict[str, float]]:
    """Generate one assistant turn per row and append it to ``batch["message_log"]``.

    Args:
        policy_generation: the generation backend.
        generation_input_data: ``input_ids`` ``[B, S]``, ``input_lengths`` ``[B]`` and optional
            ``stop_strings`` of the rows' conversations.
        batch: the rows (``message_log`` per row), changed in place and returned.
        tokenizer: decodes the generated ids into the message text.
        input_lengths: ``[B]`` prompt lengths in tokens.
        include_logprobs: keep the engine's logprob of each generated token in the message
            (``generation_logprobs``, ``[n]`` float32).
        greedy: argmax decoding.

    Returns:
        ``(batch, generated_ids, metrics)``: ``generated_ids`` one ``[n_i]`` tensor per row;
        ``batch["truncated"]`` ``[B]`` bool is set (generation hit the token limit);
        metrics: ``mean_generation_length`` (tokens) and ``max_generation_length``.
    """
    output = policy_generation.generate(generation_input_data, greedy=greedy)
    generated, metrics = append_responses(batch, output, tokenizer, input_lengths, include_logprobs)
    return batch, generated, metrics


def append_responses(
    batch: BatchedDataDict,
    output: BatchedDataDict,
    tokenizer: Any,
    input_lengths: torch.Tensor,
    include_logprobs: bool = True,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Append each row's generated turn (a GenerationOutputSpec ``output``) to
    ``batch["message_log"]``; the rest of :func:`generate_responses` (same arguments and
    results, less the batch)."""
    generated: list[torch.Tensor] = []
    for row, log in enumerate(batch["message_log"]):
        start = int(input_lengths[row])
        end = start + int(output["generation_lengths"][row])
        ids = output["output_ids"][row, start:end].to(torch.long)
        message: Message = {
            "role": "assistant",
            "content": tokenizer.decode(ids.tolist(), skip_special_tokens=False),
            "token_ids": ids,
        }
        if include_logprobs:
            message["generation_logprobs"] = output["logprobs"][row, start:end].float()
        log.append(message)
        generated.append(ids)
    batch["truncated"] = output["truncated"].bool()
    lengths = output["generation_lengths"].float()
    metrics = {
        "mean_generation_length": float(lengths.mean()) if lengths.numel() else 0.0,
        "max_generation_length": float(lengths.max()) if lengths.numel() else 0.0,
    }
    return generated, metrics


def _metadata(batch: BatchedDataDict, row: int) -> dict[str, Any]:
    return dict(batch["extra_env_info"][row] or {})


def check_tasks(task_names: list[str], task_to_env: dict[str, EnvironmentInterface]) -> None:
    """Raise KeyError naming the first row whose task has no environment, and the known tasks."""
    for row, task in enumerate(task_names):
        if task not in task_to_env:
            raise KeyError(
                f"row {row} has task_name {task!r} but no environment is configured for it; "
                f"known tasks: {sorted(task_to_env)}"
            )


def calculate_rewards(
    batch: BatchedDataDict,
    task_to_env: dict[str, EnvironmentInterface],
    metadata: Optional[list[dict[str, Any]]] = None,
) -> tuple[EnvironmentReturn, list[dict[str, float]], list[Optional[str]]]:
    """Ask each row's environment about its last assistant turn.

    Rows are grouped by ``task_name`` and each group goes to its environment in one call; an
    environment that raises or times out scores its rows 0 and ends their episodes.

    Args:
        batch: rows with ``message_log``, ``task_name`` and ``extra_env_info``.
        task_to_env: environment (Ray actor handle) per task name.
        metadata: per-row environment state from the previous turn; None: ``extra_env_info``.

    Returns:
        ``(env_return, components, errors)`` with the rows in ``batch`` order:
        ``env_return.rewards`` is ``[B]`` float32 (for an environment returning several
        rewards, their sum); ``components[r]`` is ``{"reward/<name>": reward}`` of row ``r``
        (empty when its environment returned one reward); ``errors[r]`` is None, or
        ``"environment '<task>': <what went wrong>"`` when row ``r``'s environment failed.

    Raises:
        KeyError: a row's ``task_name`` has no environment (names the row and the known tasks).
    """
    size = len(batch["message_log"])
    metadata = metadata if metadata is not None else [_metadata(batch, r) for r in range(size)]
    check_tasks(batch["task_name"], task_to_env)
    rows_by_task: dict[str, list[int]] = {}
    for row, task in enumerate(batch["task_name"]):
        rows_by_task.setdefault(task, []).append(row)

    observations: list[Any] = [None] * size
    new_metadata: list[Any] = [None] * size
    stop_strings: list[Any] = [None] * size
    answers: list[Any] = [None] * size
    rewards = torch.zeros(size, dtype=torch.float32)
    components: list[dict[str, float]] = [{} for _ in range(size)]
    terminateds = torch.zeros(size, dtype=torch.bool)
    errors: list[Optional[str]] = [None] * size
    for task, rows in rows_by_task.items():
        result, error = safe_env_step(
            task_to_env[task],
            [batch["message_log"][r] for r in rows],
            [metadata[r] for r in rows],
            ENV_STEP_TIMEOUT_S,
        )
        total, named = split_rewards(result.rewards, len(rows))
        for i, row in enumerate(rows):
            errors[row] = None if error is None else f"environment {task!r}: {error}"
            components[row] = {key: float(value[i]) for key, value in named.items()}
            observations[row] = result.observations[i]
            new_metadata[row] = result.metadata[i]
            stop_strings[row] = result.next_stop_strings[i]
            answers[row] = result.answers[i]
        rewards[rows] = total
        terminateds[rows] = result.terminateds.bool()
    return (
        EnvironmentReturn(observations, new_metadata, stop_strings, rewards, terminateds, answers),
        components,
        errors,
    )


def _observation_message(observation: dict[str, str], tokenizer: Any) -> Message:
    content = observation.get("content", "")
    ids = tokenizer(content, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return {"role": observation.get("role", "environment"), "content": content, "token_ids": ids}


def run_multi_turn_rollout(
    policy_generation: GenerationInterface,
    input_batch: BatchedDataDict,
    tokenizer: Any,
    task_to_env: dict[str, EnvironmentInterface],
    max_seq_len: int,
    max_rollout_turns: int,
    greedy: bool = False,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """Roll every sample of ``input_batch`` out against its environment.

    Args:
        policy_generation: the generation backend (awake).
        input_batch: ``DatumSpec`` rows (``message_log``, ``extra_env_info``, ``task_name``,
            optional ``stop_strings``); not modified.
        tokenizer: decodes responses and tokenizes observations.
        task_to_env: environment per task name.
        max_seq_len: most tokens a conversation may hold; a sample reaching it stops
            (truncated) and a response is cut to fit.
        max_rollout_turns: most assistant turns per sample (a recipe's
            ``grpo.max_rollout_turns``, ``distillation.max_rollout_turns`` or
            ``eval.max_rollout_turns``: the config holds the default).
        greedy: argmax decoding.

    Returns:
        ``(batch, metrics)``. ``batch`` is a copy of ``input_batch`` whose ``message_log`` holds
        the whole interaction, plus ``total_reward`` ``[B]`` float32 (sum over turns),
        ``truncated`` ``[B]`` bool (reached ``max_seq_len``), ``response_truncated`` ``[B]`` bool
        (the last response stopped at a token limit, ``max_new_tokens`` or ``max_seq_len``,
        instead of a stop token), ``terminated`` ``[B]`` bool (the environment ended the
        episode), ``num_turns`` ``[B]`` int64, ``answers`` (B strings or None: the answer
        the environment extracted from each sample's last judged response), ``env_error``
        (B strings or None: ``"environment '<task>': <error>"`` where the sample's environment
        failed, which scores it 0 and ends it) and, when an environment returned several
        rewards, each of them as ``reward/<name>`` ``[B]`` float32 (sum over turns; 0 for a
        sample that never got it). Metrics: ``mean_turns_per_sample``,
        ``total_generated_tokens``, ``mean_generated_tokens_per_sample``, ``truncation_rate``,
        ``max_new_tokens_hit_rate`` (turns that stopped at the per-turn token limit),
        ``natural_termination_rate``, ``env_time_s``, ``generation_time_s``, ``env_errors``
        (samples whose environment failed), ``env_error_rate`` (their share), ``reward_mean``,
        ``reward_std``.

    Raises:
        ValueError: a prompt already holds ``max_seq_len`` tokens or more (names the row).
        KeyError: a row's ``task_name`` has no environment (names the row and the known tasks).
    """
    batch, samples, pad = start_samples(input_batch, tokenizer, task_to_env, max_seq_len)
    env_time = gen_time = 0.0
    active = list(range(len(samples)))
    for _turn in range(max_rollout_turns):
        if not active:
            break
        current = [samples[r] for r in active]
        logs = [sample.log for sample in current]
        gen_input = generation_input(logs, [sample.stop_strings for sample in current], pad)
        sub = BatchedDataDict(message_log=logs)
        start = time.perf_counter()
        sub, _, _ = generate_responses(
            policy_generation, gen_input, sub, tokenizer, gen_input["input_lengths"], greedy=greedy
        )
        gen_time += time.perf_counter() - start
        at_limit = [
            sample.take_response(
                int(gen_input["input_lengths"][i]), bool(sub["truncated"][i]), max_seq_len,
                tokenizer,
            )
            for i, sample in enumerate(current)
        ]
        env_batch = BatchedDataDict(message_log=logs, task_name=[s.task for s in current])
        start = time.perf_counter()
        env_return, components, errors = calculate_rewards(
            env_batch, task_to_env, [sample.metadata for sample in current]
        )
        env_time += time.perf_counter() - start
        active = [
            row
            for i, (row, sample) in enumerate(zip(active, current))
            if sample.take_env_answer(
                env_return, components[i], i, errors[i], at_limit[i], max_seq_len, tokenizer
            )
        ]
    return finish_samples(batch, samples, env_time=env_time, gen_time=gen_time)


@dataclass
class SampleRollout:
    """One sample's rollout so far (the state both rollout loops keep per sample).

    Attributes:
        log: the conversation; the rollout batch's own list, appended in place.
        task: the sample's ``task_name``.
        metadata: the environment's state for the sample (``extra_env_info`` at the start).
        stop_strings: stop strings of the sample's next turn.
        generated_tokens: assistant tokens so far (after cuts to ``max_seq_len``).
        turns_at_token_limit: turns whose generation stopped at ``max_new_tokens``.
        The rest: the per-sample fields of :func:`run_multi_turn_rollout`'s result.
    """

    log: LLMMessageLogType
    task: str
    metadata: dict[str, Any]
    stop_strings: Optional[list[str]]
    total_reward: float = 0.0
    num_turns: int = 0
    truncated: bool = False
    response_truncated: bool = False
    terminated: bool = False
    answer: Optional[str] = None
    env_error: Optional[str] = None
    reward_components: dict[str, float] = field(default_factory=dict)
    generated_tokens: int = 0
    turns_at_token_limit: int = 0

    def take_response(
        self, prompt_len: int, engine_truncated: bool, max_seq_len: int, tokenizer: Any
    ) -> bool:
        """Account for the assistant turn just appended to :attr:`log` (generated after a
        ``prompt_len``-token prompt; ``engine_truncated``: it stopped at ``max_new_tokens``),
        cutting it to the room left under ``max_seq_len``; True when the conversation is now
        ``max_seq_len`` tokens long."""
        self.num_turns += 1
        message = self.log[-1]
        room = max_seq_len - prompt_len
        if message["token_ids"].numel() > room:
            message["token_ids"] = message["token_ids"][:room]
            message["generation_logprobs"] = message["generation_logprobs"][:room]
            message["content"] = tokenizer.decode(message["token_ids"].tolist())
        tokens = int(message["token_ids"].numel())
        self.generated_tokens += tokens
        self.turns_at_token_limit += int(engine_truncated)
        at_limit = prompt_len + tokens >= max_seq_len
        self.response_truncated = engine_truncated or at_limit
        return at_limit

    def take_env_answer(
        self,
        env_return: EnvironmentReturn,
        components: dict[str, float],
        i: int,
        error: Optional[str],
        at_limit: bool,
        max_seq_len: int,
        tokenizer: Any,
    ) -> bool:
        """Apply row ``i`` of the environment's answer to the last turn (``components``: the
        row's named rewards, :func:`calculate_rewards`; ``error``: its failure, if any;
        ``at_limit``: :meth:`take_response`'s result); True when the sample goes on to another
        turn (the observation, if any, appended to :attr:`log`)."""
        if error is not None and self.env_error is None:
            self.env_error = error
        self.total_reward += float(env_return.rewards[i])
        for key, value in components.items():
            self.reward_components[key] = self.reward_components.get(key, 0.0) + value
        self.answer = env_return.answers[i]
        self.metadata = env_return.metadata[i] or {}
        if env_return.terminateds[i]:
            self.terminated = True
            return False
        if at_limit:
            self.truncated = True
            return False
        observation = env_return.observations[i]
        if observation and observation.get("content"):
            obs_message = _observation_message(observation, tokenizer)
            length = message_log_length(self.log) + int(obs_message["token_ids"].numel())
            if length >= max_seq_len:
                self.truncated = True
                return False
            self.log.append(obs_message)
        self.stop_strings = env_return.next_stop_strings[i]
        return True


def start_samples(
    input_batch: BatchedDataDict,
    tokenizer: Any,
    task_to_env: dict[str, EnvironmentInterface],
    max_seq_len: int,
) -> tuple[BatchedDataDict, list[SampleRollout], int]:
    """The rollout batch (a copy of ``input_batch`` whose message logs the rollout extends),
    one :class:`SampleRollout` per row and the pad token id.

    Raises:
        ValueError: a prompt already holds ``max_seq_len`` tokens or more (names the row).
        KeyError: a row's task has no environment.
    """
    batch = BatchedDataDict(
        {
            key: ([list(log) for log in value] if key == "message_log" else value)
            for key, value in input_batch.items()
        }
    )
    for row, log in enumerate(batch["message_log"]):
        length = message_log_length(log)
        if length >= max_seq_len:
            raise ValueError(
                f"row {row}: the prompt has {length} tokens, not below max_seq_len={max_seq_len}; "
                "raise policy.max_total_sequence_length or shorten the prompt "
                "(data.max_input_seq_length)"
            )
    check_tasks(batch["task_name"], task_to_env)
    size = len(batch["message_log"])
    stop_strings = list(batch.get("stop_strings", [None] * size))
    samples = [
        SampleRollout(log, batch["task_name"][r], _metadata(batch, r), stop_strings[r])
        for r, log in enumerate(batch["message_log"])
    ]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return batch, samples, pad


def finish_samples(
    batch: BatchedDataDict, samples: list[SampleRollout], *, env_time: float, gen_time: float
) -> tuple[BatchedDataDict, dict[str, float]]:
    """:func:`run_multi_turn_rollout`'s result from the rollout batch and its samples;
    ``env_time`` / ``gen_time``: seconds the rollout spent waiting on environments /
    generation."""
    size = len(samples)
    total_reward = torch.tensor([s.total_reward for s in samples], dtype=torch.float32)
    truncated = torch.tensor([s.truncated for s in samples], dtype=torch.bool)
    terminated = torch.tensor([s.terminated for s in samples], dtype=torch.bool)
    num_turns = torch.tensor([s.num_turns for s in samples], dtype=torch.long)
    batch["total_reward"] = total_reward
    batch["truncated"] = truncated
    batch["response_truncated"] = torch.tensor(
        [s.response_truncated for s in samples], dtype=torch.bool
    )
    batch["terminated"] = terminated
    batch["num_turns"] = num_turns
    batch["answers"] = [s.answer for s in samples]
    batch["env_error"] = [s.env_error for s in samples]
    for key in sorted({key for s in samples for key in s.reward_components}):
        batch[key] = torch.tensor(
            [s.reward_components.get(key, 0.0) for s in samples], dtype=torch.float32
        )
    generated_tokens = sum(s.generated_tokens for s in samples)
    env_errors = sum(s.env_error is not None for s in samples)
    metrics = {
        "mean_turns_per_sample": float(num_turns.float().mean()),
        "total_generated_tokens": float(generated_tokens),
        "mean_generated_tokens_per_sample": generated_tokens / max(size, 1),
        "truncation_rate": float(truncated.float().mean()),
        "max_new_tokens_hit_rate": sum(s.turns_at_token_limit for s in samples)
        / max(int(num_turns.sum()), 1),
        "natural_termination_rate": float(terminated.float().mean()),
        "env_time_s": env_time,
        "generation_time_s": gen_time,
        "env_errors": float(env_errors),
        "env_error_rate": env_errors / max(size, 1),
        "reward_mean": float(total_reward.mean()),
        "reward_std": float(total_reward.std()) if size > 1 else 0.0,
    }
    return batch, metrics
