"""Agent plug-ins (``env.<task>.agent_fn``): checked when the recipe is validated (import
path, signature, ``timeout_s``, keys), and the calculator agent's handling of failed calls and
its reading of the final answer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_rl.environments.agent_environment import AgentEnvironment
from nemo_rl.environments.calculator_agent import answer_tool_call, final_answer
from nemo_rl.environments.config import EnvConfigs


def test_an_agent_section_is_checked_at_config_time() -> None:
    good = {"math": None, "calc": {"agent_fn": "nemo_rl.environments.calculator_agent:run"}}
    specs = EnvConfigs.model_validate(good).specs()
    assert specs["calc"].cls is AgentEnvironment
    assert specs["calc"].kwargs == {"agent_fn": "nemo_rl.environments.calculator_agent:run"}
    assert EnvConfigs.model_validate(good).agent_tasks() == ["calc"]
    wrong = [
        ({"agent_fn": "nemo_rl.environments.calculator_agent:final_answer"},
         "cannot be called as fn(base_url, row) -> float"),
        ({"agent_fn": "nemo_rl.environments.calculator_agent:nope"}, "has no attribute 'nope'"),
        ({"agent_fn": "nemo_rl.environments.calculator_agent:run", "timeout_s": 0},
         "env.calc.timeout_s=0: give seconds in (0, 240]"),
        ({"agent_fn": "nemo_rl.environments.calculator_agent:run", "retries": 2},
         "cannot be started with the section's keys"),
        ({"agent_fn": "nemo_rl.environments.calculator_agent:run",
          "reward_fn": "nemo_rl.environments.calculator_agent:run"}, "exactly one of"),
    ]
    for section, message in wrong:
        with pytest.raises(ValueError, match=re.escape(message)):
            EnvConfigs.model_validate({"math": None, "calc": section})


def test_the_agent_answers_failed_calls_without_raising() -> None:
    call = {"id": "c", "function": {"name": "search", "arguments": "{}"}}
    assert answer_tool_call(call) == "error: unknown tool 'search'; the only tool is 'calc'"
    call = {"id": "c", "function": {"name": "calc", "arguments": '{"expression": "2 +"}'}}
    assert answer_tool_call(call).startswith("error: ")
    assert final_answer("so <answer>42</answer>") == "42"
    assert final_answer("it is 4 or 7") == "7"
    assert final_answer("no idea") is None


def test_agents_and_the_endpoint_go_together_at_config_time() -> None:
    from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
    from nemo_rl.utils.config import ConfigError, load_typed_config

    recipe = Path(__file__).resolve().parents[3] / "configs" / "grpo_agent_calculator_tiny_cpu.yaml"
    cfg = load_typed_config(recipe, [], GRPOMasterConfig)
    assert cfg.policy.generation.vllm_cfg.expose_http_server
    for overrides, message in [
        (["policy.generation.vllm_cfg.expose_http_server=false"],
         "env.agent_calculator.agent_fn runs its episodes against the engines' HTTP endpoint: "
         "set policy.generation.vllm_cfg.expose_http_server=true"),
        (["env.math={}"], "but env.math is not one"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_typed_config(recipe, overrides, GRPOMasterConfig)
