"""Rollouts driven by agents over the engines' HTTP endpoint (``vllm_cfg.expose_http_server``).

:func:`run_agent_rollout` takes and returns what
:func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` does. Instead of generating turns
itself, it gives every sample an episode of its own: a rollout id and the base URL of one
engine (``http://<engine>/rollouts/<id>/v1``; samples are spread over the engines in turn),
and has the sample's environment, an agent plug-in
(:class:`~nemo_rl.environments.agent_environment.AgentEnvironment`), run it. The agent drives
as many turns as it likes; the engine records each request's prompt and generated token ids
with their logprobs and weight version (:mod:`nemo_rl.models.generation.http_records`).

The training sample is assembled from those records, never from text: the first request's
prompt ids are the prompt (role ``user``), each response's generated ids and logprobs an
``assistant`` message (with its ``weight_version``), and the ids a later request added after
the previous response (tool results, user turns, the template's markup) a ``tool`` message,
not trained. Only one chain of requests can be one sample: the chain that ends with the
agent's last request, each of its requests extending the one before
(:attr:`~nemo_rl.models.generation.http_records.CallRecord.extends_previous`); requests outside
it are counted (metric ``agent_unchained_calls``) and not trained. A sample whose agent made
no request, or failed, scores 0 and counts as an environment error
(``env_errors``, ``grpo.max_env_error_rate``); its message log is its prompt alone or what
the agent generated before failing.

``max_rollout_turns`` does not bound an agent (the agent decides); a chain longer than
``max_seq_len`` is cut there (``truncated``). ``greedy`` is not available: the endpoint samples
as the policy does.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nemo_rl.data.interfaces import LLMMessageLogType, Message
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.agent_environment import BASE_URL_KEY
from nemo_rl.environments.interfaces import EnvironmentInterface
from nemo_rl.experience.rollouts import (
    SampleRollout,
    calculate_rewards,
    finish_samples,
    start_samples,
)
from nemo_rl.models.generation.http_records import CallRecord


def trained_chain(calls: list[CallRecord]) -> list[CallRecord]:
    """The requests one sample trains on: the longest run of ``calls`` ending with the last,
    each extending the one before (empty for no calls)."""
    start = len(calls) - 1
    while start > 0 and calls[start].extends_previous:
        start -= 1
    return calls[max(start, 0):]


def _message(role: str, ids: list[int], tokenizer: Any) -> Message:
    return {
        "role": role,
        "content": tokenizer.decode(ids, skip_special_tokens=False),
        "token_ids": torch.tensor(ids, dtype=torch.long),
    }


def chain_message_log(chain: list[CallRecord], tokenizer: Any, max_seq_len: int) -> tuple[
    LLMMessageLogType, bool
]:
    """The message log of a chain of requests (module docstring) cut at ``max_seq_len``
    tokens; second: whether it was cut."""
    log: LLMMessageLogType = [_message("user", chain[0].prompt_ids, tokenizer)]
    length = len(chain[0].prompt_ids)
    for k, call in enumerate(chain):
        if k > 0:
            previous = chain[k - 1]
            added = call.prompt_ids[len(previous.prompt_ids) + len(previous.generated_ids):]
            if added:
                log.append(_message("tool", added, tokenizer))
                length += len(added)
        room = max_seq_len - length
        if room <= 0:
            return log, True
        ids, logprobs = call.generated_ids[:room], call.logprobs[:room]
        message = _message("assistant", ids, tokenizer)
        message["generation_logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
        message["weight_version"] = call.weight_version
        log.append(message)
        length += len(ids)
        if len(ids) < len(call.generated_ids):
            return log, True
    return log, False


def _take_chain(sample: SampleRollout, calls: list[CallRecord], tokenizer: Any,
                max_seq_len: int) -> int:
    """Replace ``sample``'s log with its trained chain; the number of untrained calls."""
    chain = trained_chain(calls)
    if not chain:
        return 0
    log, cut = chain_message_log(chain, tokenizer, max_seq_len)
    sample.log[:] = log
    sample.num_turns = len(chain)
    sample.generated_tokens = sum(
        int(m["token_ids"].numel()) for m in log if m["role"] == "assistant"
    )
    sample.turns_at_token_limit = sum(c.finish_reason == "length" for c in chain)
    sample.truncated = cut
    sample.response_truncated = cut or chain[-1].finish_reason == "length"
    return len(calls) - len(chain)


def run_agent_rollout(
    policy_generation: Any, input_batch: BatchedDataDict, tokenizer: Any,
    task_to_env: dict[str, EnvironmentInterface], max_seq_len: int, max_rollout_turns: int,
    greedy: bool = False,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """Roll every sample out through its agent (module docstring); arguments, result and
    metrics as :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout`'s, plus the
    metrics ``agent_calls`` (requests per sample) and ``agent_unchained_calls`` (requests not
    trained, per sample).

    Args:
        policy_generation: an :class:`~nemo_rl.models.generation.vllm.async_generation.
            AsyncVllmGeneration` whose engines serve HTTP (``http_base_urls``).
    """
    del max_rollout_turns, greedy  # the agents decide; the endpoint samples as the policy
    batch, samples, _ = start_samples(input_batch, tokenizer, task_to_env, max_seq_len)
    step = policy_generation.reserve_sampling_step()
    urls = policy_generation.http_base_urls
    episodes = [(row % len(urls), f"step{step}-sample{row}") for row in range(len(samples))]
    metadata = [
        {**sample.metadata, BASE_URL_KEY: f"{urls[replica]}/rollouts/{rid}/v1"}
        for sample, (replica, rid) in zip(samples, episodes)
    ]
    env_batch = BatchedDataDict(
        message_log=[s.log for s in samples], task_name=[s.task for s in samples]
    )
    start = time.perf_counter()
    env_return, components, errors = calculate_rewards(env_batch, task_to_env, metadata)
    env_time = time.perf_counter() - start
    records = policy_generation.take_http_records(episodes)
    calls = unchained = 0
    for i, (sample, (_, rid)) in enumerate(zip(samples, episodes)):
        sample_calls = records.get(rid, [])
        calls += len(sample_calls)
        unchained += _take_chain(sample, sample_calls, tokenizer, max_seq_len)
        agent_error = (env_return.metadata[i] or {}).get("agent_error")
        if errors[i] is None and agent_error is None and not sample_calls:
            agent_error = "the agent made no request to its endpoint"
        sample.env_error = errors[i] or (
            None if agent_error is None else f"environment {sample.task!r}: {agent_error}"
        )
        sample.total_reward = 0.0 if sample.env_error else float(env_return.rewards[i])
        sample.reward_components = {} if sample.env_error else dict(components[i])
        sample.terminated = sample.env_error is None and not sample.truncated
        sample.metadata = {}
    batch, metrics = finish_samples(batch, samples, env_time=env_time, gen_time=0.0)
    metrics["agent_calls"] = calls / max(len(samples), 1)
    metrics["agent_unchained_calls"] = unchained / max(len(samples), 1)
    return batch, metrics
