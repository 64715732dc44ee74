"""Multi-turn rollouts without a batch barrier (``policy.generation.vllm_cfg.async_engine``).

:func:`run_async_multi_turn_rollout` takes and returns what
:func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` does, but rolls every sample out as
its own asyncio task: generate a turn (one
:meth:`~nemo_rl.models.generation.interfaces.AsyncGenerationInterface.generate_async` call),
let the environment judge it, append the observation, go on. A sample whose environment
answers quickly, or whose responses are short, runs through its turns while slower samples are
still generating or waiting on their environments; the engine batches whatever requests are
in flight. The per-turn rules (cuts at ``max_seq_len``, truncation, termination, stop strings,
environment failures) are the batched loop's own (:class:`~nemo_rl.experience.rollouts.
SampleRollout`), so greedy decoding gives the batched path's results.

Environment steps are blocking Ray calls (:func:`~nemo_rl.experience.rollouts.
calculate_rewards`, one sample per call); they run on a thread pool of up to
:data:`ENV_STEP_THREADS` threads. An environment actor answers one call at a time unless it was
made with ``max_concurrency`` > 1, so samples of one slow environment still queue at its actor.

``env_time_s`` / ``generation_time_s`` are the wall time during which at least one sample was
waiting on an environment / on generation; the two overlap here, unlike in the batched loop.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import EnvironmentInterface
from nemo_rl.experience.agent_rollouts import run_agent_rollout
from nemo_rl.experience.rollouts import (
    SampleRollout,
    append_responses,
    calculate_rewards,
    finish_samples,
    generation_input,
    run_multi_turn_rollout,
    start_samples,
)
from nemo_rl.models.generation.interfaces import AsyncGenerationInterface, GenerationInterface

# Most environment steps in flight at once (threads blocked on their Ray answers).
ENV_STEP_THREADS = 128


class _BusyClock:
    """Wall time (seconds) during which at least one task was inside the clocked block.
    Used from one event loop, so no lock."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inside = 0
        self._since = 0.0

    def __enter__(self) -> None:
        if self._inside == 0:
            self._since = time.perf_counter()
        self._inside += 1

    def __exit__(self, *exc: object) -> None:
        self._inside -= 1
        if self._inside == 0:
            self.seconds += time.perf_counter() - self._since


def run_async_multi_turn_rollout(
    policy_generation: AsyncGenerationInterface,
    input_batch: BatchedDataDict,
    tokenizer: Any,
    task_to_env: dict[str, EnvironmentInterface],
    max_seq_len: int,
    max_rollout_turns: int,
    greedy: bool = False,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """:func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` (same arguments, result,
    metrics and errors) with each sample advancing on its own.

    Sampled requests are seeded by ``(sample, sampling step, turn)``; the rollout takes one
    sampling step. Call it from synchronous code (it runs its own event loop).
    """
    batch, samples, pad = start_samples(input_batch, tokenizer, task_to_env, max_seq_len)
    step = policy_generation.reserve_sampling_step()
    clocks = {"env": _BusyClock(), "generation": _BusyClock()}

    async def roll_out(row: int, sample: SampleRollout, pool: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        for turn in range(max_rollout_turns):
            gen_input = generation_input([sample.log], [sample.stop_strings], pad)
            with clocks["generation"]:
                output = await policy_generation.generate_async(
                    gen_input, greedy, seed_key=(row, step, turn)
                )
            append_responses(
                BatchedDataDict(message_log=[sample.log]), output, tokenizer,
                gen_input["input_lengths"],
            )
            at_limit = sample.take_response(
                int(gen_input["input_lengths"][0]), bool(output["truncated"][0]), max_seq_len,
                tokenizer,
            )
            env_batch = BatchedDataDict(message_log=[sample.log], task_name=[sample.task])
            with clocks["env"]:
                env_return, components, errors = await loop.run_in_executor(
                    pool, calculate_rewards, env_batch, task_to_env, [sample.metadata]
                )
            if not sample.take_env_answer(
                env_return, components[0], 0, errors[0], at_limit, max_seq_len, tokenizer
            ):
                return

    async def roll_out_all() -> None:
        with ThreadPoolExecutor(min(len(samples), ENV_STEP_THREADS)) as pool:
            await asyncio.gather(*(roll_out(r, s, pool) for r, s in enumerate(samples)))

    asyncio.run(roll_out_all())
    return finish_samples(
        batch, samples, env_time=clocks["env"].seconds, gen_time=clocks["generation"].seconds
    )


def multi_turn_rollout_for(
    generation: GenerationInterface,
) -> Callable[..., tuple[BatchedDataDict, dict[str, float]]]:
    """The rollout for ``generation``: the agent rollout
    (:func:`~nemo_rl.experience.agent_rollouts.run_agent_rollout`) for engines serving HTTP
    (``vllm_cfg.expose_http_server``), :func:`run_async_multi_turn_rollout` for an engine that
    generates per sample (``vllm_cfg.async_engine``), else the batched
    :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` (same arguments)."""
    if getattr(generation, "http_base_urls", None):
        return run_agent_rollout
    if isinstance(generation, AsyncGenerationInterface):
        return run_async_multi_turn_rollout
    return run_multi_turn_rollout
