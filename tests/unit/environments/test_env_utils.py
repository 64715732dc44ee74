"""Fault handling and environment actors: safe_env_step, create/shutdown_environments, config."""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch

from nemo_rl.environments.config import EnvConfigs
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.environments.math_environment import MathEnvironment
from nemo_rl.environments.sandbox import isolation_problem
from nemo_rl.environments.utils import (
    create_environments,
    environment_metrics,
    remote_environment,
    tasks_with_metrics,
    safe_env_step,
    shutdown_environments,
)
from nemo_rl.utils.config import ConfigError, validate_config
from nemo_rl.utils.fault_injection import FAULTS_DIR_ENV, FAULTS_ENV


def conversation(answer: str) -> list[dict]:
    return [{"role": "assistant", "content": answer, "token_ids": torch.zeros(1, dtype=torch.long)}]


class FlakyEnvironment(MathEnvironment):
    """Math judge that raises on metadata ``{"fail": True}`` and hangs on ``{"hang": True}``;
    on ``{"echo": True}`` it returns, as each sample's metadata, the last message's
    ``token_ids`` it received, and adds 1 to them in place (they must be its own, writable)."""

    def step(self, message_log_batch, metadata):
        if any(m.get("fail") for m in metadata):
            raise RuntimeError("environment bug")
        if any(m.get("hang") for m in metadata):
            time.sleep(600)
        out = super().step(message_log_batch, metadata)
        if not any(m.get("echo") for m in metadata):
            return out
        seen = []
        for log in message_log_batch:
            ids = log[-1]["token_ids"]
            seen.append({"token_ids": ids.clone(), "plus_one": ids.add_(1).tolist()})
        return out._replace(metadata=seen)


class ShortEnvironment(MathEnvironment):
    """Answers one sample fewer than asked."""

    def step(self, message_log_batch, metadata):
        return super().step(message_log_batch[1:], metadata[1:])


class UnprefixedRewardsEnvironment(MathEnvironment):
    """Returns named rewards without the ``reward/`` prefix."""

    def step(self, message_log_batch, metadata):
        out = super().step(message_log_batch, metadata)
        return out._replace(rewards={"correctness": out.rewards})


def assert_failed(out: EnvironmentReturn, size: int) -> None:
    assert out.rewards.tolist() == [0.0] * size
    assert out.terminateds.tolist() == [True] * size
    assert [o["content"] for o in out.observations] == [""] * size
    assert out.metadata == [None] * size and out.answers == [None] * size


def test_in_process_environment_failures_score_zero():
    logs, meta = [conversation("1"), conversation("2")], [{"ground_truth": "1"}] * 2
    out, error = safe_env_step(MathEnvironment(), logs, meta, timeout_s=5)
    assert error is None and out.rewards.tolist() == [1.0, 0.0]
    failing = [{"ground_truth": "1", "fail": True}] * 2
    out, error = safe_env_step(FlakyEnvironment(), logs, failing, timeout_s=5)
    assert error == "RuntimeError('environment bug')"
    assert_failed(out, 2)
    out, error = safe_env_step(ShortEnvironment(), logs, meta, timeout_s=5)
    assert error is not None and "wrong length for 2 samples" in error
    assert_failed(out, 2)
    out, error = safe_env_step(UnprefixedRewardsEnvironment(), logs, meta, timeout_s=5)
    assert error is not None and "rewards key 'correctness' lacks the 'reward/' prefix" in error
    assert_failed(out, 2)


def test_env_configs_defaults_and_errors():
    cfg = EnvConfigs()
    assert cfg.math is not None and cfg.math.num_workers == 1
    assert cfg.number_guess is None and cfg.calculator is None
    with pytest.raises(ConfigError, match="math.num_workrs; did you mean math.num_workers"):
        validate_config({"math": {"num_workrs": 2}}, EnvConfigs, source="env")


def test_environments_implement_the_interface():
    assert issubclass(MathEnvironment, EnvironmentInterface)


@pytest.mark.slow
def test_actors_from_config_step_and_shut_down(local_ray_8cpu):
    envs = create_environments({"math": {}, "number_guess": {"max_turns": 2}})
    try:
        assert sorted(envs) == ["math", "number_guess"]
        out, error = safe_env_step(
            envs["math"], [conversation("\\boxed{0.5}")], [{"ground_truth": "1/2"}], timeout_s=60
        )
        assert error is None and out.rewards.tolist() == [1.0]
        out, error = safe_env_step(
            envs["number_guess"], [conversation("<guess>3")], [{"secret": 5}], timeout_s=60
        )
        assert error is None and out.observations[0]["content"] == "higher"
        assert out.metadata == [{"secret": 5, "turn": 1}]
    finally:
        shutdown_environments(envs)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(envs["math"].step.remote([conversation("1")], [{"ground_truth": "1"}]), timeout=60)


@pytest.mark.slow
@pytest.mark.skipif(isolation_problem() is not None, reason="isolated sandbox unavailable")
def test_code_environment_actor_runs_the_sandbox_and_reports_its_counts(local_ray_8cpu):
    env_cfgs = EnvConfigs.model_validate({"math": {}, "code": {"timeout_s": 2, "cpu_time_s": 1}})
    tasks = tasks_with_metrics(env_cfgs)
    assert tasks == {"code"}  # math keeps no counts: it is never asked
    envs = create_environments(env_cfgs)
    try:
        reply = "<code>import socket\nsocket.create_connection(('127.0.0.1', 1))</code>"
        out, error = safe_env_step(envs["code"], [conversation(reply)], [{"tests": ["pass"]}], 60)
        assert error is None and "Network is unreachable" in out.observations[0]["content"]
        metrics = environment_metrics(envs, tasks)
        assert metrics["env/code/code_runs"] == 1.0
        assert metrics["env/code/code_network_denials"] == 1.0
        assert environment_metrics(envs, tasks)["env/code/code_runs"] == 0.0  # since the last call
    finally:
        shutdown_environments(envs)
    assert environment_metrics(envs, tasks) == {}  # dead actors are left out, nothing raised


@pytest.mark.slow
def test_raising_and_hanging_actors_score_zero_and_the_run_goes_on(local_ray_8cpu):
    env = remote_environment(FlakyEnvironment, 0.25, EnvConfigs().math)
    try:
        logs = [conversation("\\boxed{3}"), conversation("\\boxed{4}")]
        out, error = safe_env_step(env, logs, [{"ground_truth": "3", "fail": True}] * 2, 60)
        assert error == "RuntimeError('environment bug')"  # the remote exception, not Ray's wrapper
        assert_failed(out, 2)

        out, error = safe_env_step(env, logs, [{"ground_truth": "3", "hang": True}] * 2, 3)
        assert error == "no answer within 3 s"
        assert_failed(out, 2)

        # the hung actor was replaced: the next step is judged normally
        out, error = safe_env_step(env, logs, [{"ground_truth": "3"}] * 2, 120)
        assert error is None and out.rewards.tolist() == [1.0, 0.0]

        # the conversations' tensors travel packed and reach the actor as the tensors sent
        logs[1][-1]["token_ids"] = torch.tensor([5, 6, 7])
        out, error = safe_env_step(env, logs, [{"ground_truth": "3", "echo": True}] * 2, 60)
        assert error is None and out.rewards.tolist() == [1.0, 0.0]
        for log, seen in zip(logs, out.metadata):
            ids = log[-1]["token_ids"]
            assert seen["token_ids"].dtype == ids.dtype and torch.equal(seen["token_ids"], ids)
            assert seen["plus_one"] == (ids + 1).tolist()
        assert logs[1][-1]["token_ids"].tolist() == [5, 6, 7]  # the driver's copy is untouched
    finally:
        shutdown_environments({"flaky": env})


@pytest.mark.slow
def test_an_actor_killed_during_a_step_fails_its_samples_and_is_restarted(
    local_ray_8cpu, monkeypatch, tmp_path
):
    """kill -9 of the environment's actor in its second step (test-only fault injection,
    once across processes): that step's samples score 0 with a one-line error, Ray restarts
    the actor and the next step is judged normally; the step is not sent again."""
    kill = {"point": "environment.step", "env": "MathEnvironment", "hit": 2, "action": "kill"}
    monkeypatch.setenv(FAULTS_ENV, json.dumps([kill]))
    monkeypatch.setenv(FAULTS_DIR_ENV, str(tmp_path))  # the actor gets both at its start
    env = remote_environment(MathEnvironment, 0.25, EnvConfigs().math)
    try:
        logs = [conversation("\\boxed{3}"), conversation("\\boxed{4}")]
        meta = [{"ground_truth": "3"}] * 2
        out, error = safe_env_step(env, logs, meta, 60)
        assert error is None and out.rewards.tolist() == [1.0, 0.0]

        out, error = safe_env_step(env, logs, meta, 60)
        assert error.startswith("its actor died during the step (Ray restarts it): ")
        assert "\n" not in error
        assert_failed(out, 2)
        assert (tmp_path / "fired-0").exists()

        out, error = safe_env_step(env, logs, meta, 120)
        assert error is None and out.rewards.tolist() == [1.0, 0.0]
    finally:
        shutdown_environments({"math": env})
