"""Async GRPO's collector and replay buffer against fakes: a fake loader (its state is a
position), fake engines whose weights are a version number, a trainer that bumps the version.

Proven here at unit level (no Ray): the age bound holds over many randomly timed steps and
each batch's version tag is the weights that generated it; bound 0 gives the synchronous
loop's order of generations and updates; a hung rollout is dropped and counted without
stalling the trainer; a checkpoint's resume point is the first batch not trained on; a
collector failure reaches the trainer.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from nemo_rl.algorithms.grpo_config import AsyncGRPOConfig
from nemo_rl.algorithms.grpo_step.async_grpo import AsyncRollouts, LockedPolicy, ResumeCursor
from nemo_rl.algorithms.grpo_step.replay_buffer import BufferClosed, ReplayBuffer, Trajectories
from nemo_rl.experience.grouped_rollouts import RolloutCarry
from nemo_rl.utils.timer import Timer


def make_carry(num_groups: int = 2, group_size: int = 2) -> RolloutCarry:
    zeros = torch.zeros(num_groups * group_size)
    return RolloutCarry(
        group_ids=torch.arange(num_groups).repeat_interleave(group_size), rewards=zeros,
        loss_multiplier=zeros, truncated=zeros.bool(), response_truncated=zeros.bool(),
        response_tokens=zeros.long(), metrics={}, sampling_step=0,
    )


class FakeLoader:
    """Batches are their positions 0, 1, 2, ...; the state is the next position."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        while True:
            self.pos += 1
            yield self.pos - 1

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


@dataclass
class FakeRun:
    """Engines and weights as version numbers; every event logged in order."""

    weights: int = 0
    engine_weights: int = 0
    calls: int = 0  # the engines' sampling step
    events: list[tuple[str, int]] = field(default_factory=list)
    generated_with: dict[int, int] = field(default_factory=dict)  # prompt -> engine weights
    delay_s: float = 0.0
    hang_on: int | None = None
    fail_on: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    timer: Timer = field(default_factory=Timer)

    def roll_out(self, prompt: int) -> tuple[int, RolloutCarry]:
        self.calls += 1
        self.events.append(("generate", prompt))
        self.generated_with[prompt] = self.engine_weights
        if prompt == self.hang_on:
            self.release.wait(30)
        if prompt == self.fail_on:
            raise ValueError("environment exploded")
        time.sleep(self.rng.uniform(0, self.delay_s))
        return prompt, make_carry()

    def refit(self) -> None:
        self.events.append(("refit", self.weights))
        self.engine_weights = self.weights

    def source(
        self, max_age: int, start_step: int = 0, timeout_s: float = 30.0, engines_current: bool = True
    ) -> AsyncRollouts:
        self.weights = start_step
        self.engine_weights = start_step if engines_current else -1
        return AsyncRollouts(
            self.roll_out,
            self.refit,
            FakeLoader(),
            lambda: self.calls,
            AsyncGRPOConfig(
                enabled=True, max_trajectory_age_steps=max_age, rollout_timeout_s=timeout_s
            ),
            start_step=start_step,
            engines_current=engines_current,
            policy_lock=threading.RLock(),
        )

    def train(
        self, source: AsyncRollouts, batches: Iterator[int], train_s: float = 0.0
    ) -> tuple[int, dict[str, float]]:
        """One trainer step: take, 'train' (the weights move on), return prompt and metrics."""
        prompt, _, metrics = source.take(self, None, batches)
        with source.training(self):
            self.events.append(("train", prompt))
            time.sleep(self.rng.uniform(0, train_s))
            self.weights += 1
        return prompt, metrics


@pytest.mark.parametrize("max_age", [0, 1, 3])
def test_age_bound_holds_over_many_steps_and_tags_are_the_generating_weights(max_age):
    run = FakeRun(delay_s=0.004)
    source = run.source(max_age)
    batches = iter(ResumeCursor(source))
    try:
        for step in range(60):
            prompt, metrics = run.train(source, batches, train_s=0.004)
            age = step - run.generated_with[prompt]  # the weights that really generated it
            assert 0 <= age <= max_age
            assert metrics["async/trajectory_age"] == age
            assert metrics["async/stale_groups_dropped"] == 0
            ahead = sum(1 for kind, _ in run.events if kind == "generate") - (step + 1)
            assert ahead <= max_age + 1, "the collector ran further ahead than the buffer allows"
    finally:
        source.close()
    trained = [p for kind, p in run.events if kind == "train"]
    assert trained == list(range(60)), "every prompt batch trained once, in order"


def test_bound_zero_is_the_synchronous_order():
    run = FakeRun(delay_s=0.002)
    source = run.source(0)
    batches = iter(ResumeCursor(source))
    try:
        for _ in range(5):
            run.train(source, batches)
    finally:
        source.close()
    want = [("generate", 0), ("train", 0)]
    for step in range(1, 5):
        want += [("refit", step), ("generate", step), ("train", step)]
    assert run.events[: len(want)] == want


def test_resumed_run_refits_stale_engines_before_its_first_batch():
    run = FakeRun()
    source = run.source(max_age=1, start_step=5, engines_current=False)
    batches = iter(ResumeCursor(source))
    try:
        _, metrics = run.train(source, batches)
    finally:
        source.close()
    assert run.events[:2] == [("refit", 5), ("generate", 0)]
    assert run.generated_with[0] == 5 and metrics["async/trajectory_age"] == 0


def test_buffer_drops_and_counts_batches_older_than_the_bound():
    buffer = ReplayBuffer(capacity=4)
    for version, groups in [(0, 2), (0, 3), (1, 1), (3, 2)]:
        buffer.put(Trajectories(version, make_carry(num_groups=groups), version))
    item, dropped = buffer.take(step=3, max_age=1)
    assert (item.version, dropped, buffer.stale_groups_dropped) == (3, 3, 6)
    assert len(buffer) == 0


def test_closed_buffer_wakes_a_waiting_trainer():
    buffer = ReplayBuffer(capacity=1)
    threading.Timer(0.2, buffer.close).start()
    with pytest.raises(BufferClosed):
        buffer.take(step=0, max_age=0)


def test_hung_rollout_times_out_is_counted_and_the_loop_goes_on():
    run = FakeRun(hang_on=1)
    # the other rollouts return at once: 2 s leaves a slow or loaded host room to run them
    source = run.source(max_age=1, timeout_s=2.0)
    batches = iter(ResumeCursor(source))
    try:
        results = [run.train(source, batches) for _ in range(4)]
    finally:
        run.release.set()
        source.close()
    assert [prompt for prompt, _ in results] == [0, 2, 3, 4]  # batch 1's prompts skipped
    assert sum(m["async/timed_out_rollouts"] for _, m in results) == 1


def test_resume_point_is_the_first_batch_not_trained_on():
    run = FakeRun(delay_s=0.002)
    source = run.source(max_age=2)
    cursor = ResumeCursor(source)
    batches = iter(cursor)
    sampling_before: dict[int, int] = {}
    original = run.roll_out

    def recording(prompt: int) -> tuple[int, RolloutCarry]:
        sampling_before[prompt] = run.calls
        return original(prompt)

    run.roll_out = recording  # type: ignore[method-assign]
    source.roll_out = recording
    try:
        for step in range(8):
            run.train(source, batches, train_s=0.01)
            state, sampling_step = source.resume_point()
            assert cursor.state_dict() == state == {"pos": step + 1}
            if step + 1 in sampling_before:  # already generated: its sampling step before it
                assert sampling_step == sampling_before[step + 1]
    finally:
        source.close()
    resumed = FakeLoader()
    resumed.load_state_dict(state)
    assert next(iter(resumed)) == 8


def test_collector_failure_reaches_the_trainer():
    run = FakeRun(fail_on=1)
    source = run.source(max_age=1)
    batches = iter(ResumeCursor(source))
    try:
        run.train(source, batches)
        with pytest.raises(BufferClosed, match="environment exploded") as info:
            run.train(source, batches)
        assert isinstance(info.value.__cause__, ValueError)
    finally:
        source.close()


def test_locked_policy_serialises_calls_across_threads():
    lock = threading.RLock()
    inside: list[int] = []
    overlaps: list[bool] = []

    class Policy:
        cfg = "cfg"

        def work(self, i: int) -> int:
            inside.append(i)
            overlaps.append(len(inside) > 1)
            time.sleep(0.01)
            inside.remove(i)
            return i

    policy = LockedPolicy(Policy(), lock)
    threads = [threading.Thread(target=policy.work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert policy.cfg == "cfg" and overlaps == [False] * 4
    with lock:  # re-entrant: the holder may call through the facade
        assert policy.work(7) == 7
