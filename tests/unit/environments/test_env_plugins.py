"""Environments from the recipe: plug-in classes and reward functions by import path, resolved
and checked when the config validates, with the built-ins going through the same resolution."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.data.processors import math_data_processor, prompt_only_processor, reward_fn_processor
from nemo_rl.environments.config import EnvConfigs
from nemo_rl.environments.math_environment import MathEnvironment
from nemo_rl.environments.number_guess_environment import NumberGuessEnvironment
from nemo_rl.environments.reward_fn_environment import RewardFnEnvironment
from nemo_rl.utils.config import ConfigError, validate_config

PLUGIN_MODULE = '''
import torch

from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn


class EchoEnv(EnvironmentInterface):
    """Rewards replies containing `word`."""

    default_processor = "reward_fn"
    required_fields = ("target",)

    def __init__(self, word: str, bonus: float = 0.0):
        self.word, self.bonus = word, bonus

    def step(self, message_log_batch, metadata):
        n = len(message_log_batch)
        rewards = [float(self.word in log[-1]["content"]) + self.bonus for log in message_log_batch]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""}] * n, metadata=[None] * n,
            next_stop_strings=[None] * n, rewards=torch.tensor(rewards),
            terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n,
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class Half(EnvironmentInterface):
    def step(self, message_log_batch, metadata):
        raise NotImplementedError


def length_reward(prompt, response, answer, metadata):
    return len(response) / (10.0 if answer is None else float(answer)) + metadata.get("bias", 0)


def wrong_arity(prompt, response):
    return 0.0


def not_a_number(prompt, response, answer, metadata):
    return "high"


def first_word(prompt, response, answer, metadata):
    return response.split()[0] if response.split() else None


def a_number(prompt, response, answer, metadata):
    return 7


def starts_with_a(prompt, response, answer, metadata):
    return float(response.startswith("a"))


def my_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx):
    raise NotImplementedError
'''


@pytest.fixture()
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of plug-ins written to tmp_path and importable; returns its name."""
    name = f"my_plugins_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def env(data: dict[str, Any]) -> EnvConfigs:
    return validate_config(data, EnvConfigs, source="env")


def refusal(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        env(data)
    return str(info.value)


def message(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text, "token_ids": torch.zeros(1, dtype=torch.long)}]


def test_builtins_resolve_through_the_same_mechanism() -> None:
    specs = env({"number_guess": {"num_cpus": 0.5}}).specs()
    assert sorted(specs) == ["math", "number_guess"]
    assert specs["math"].cls is MathEnvironment and specs["math"].processor is math_data_processor
    assert specs["math"].required_fields == ("answer",)
    guess = specs["number_guess"]
    assert guess.cls is NumberGuessEnvironment and guess.processor is prompt_only_processor
    assert guess.required_fields == ("secret",) and guess.num_cpus == 0.5
    assert guess.args[0].max_turns == 6  # the typed section is the class's one argument
    assert specs["math"].returns_answers and guess.returns_answers


def test_plugin_class_with_its_own_kwargs(plugins: str) -> None:
    cfg = env({"echo": {"cls": f"{plugins}:EchoEnv", "num_cpus": 0.2, "word": "hi", "bonus": 0.5}})
    spec = cfg.specs()["echo"]
    assert spec.kwargs == {"word": "hi", "bonus": 0.5} and spec.num_cpus == 0.2
    assert spec.required_fields == ("target",) and spec.processor is reward_fn_processor
    assert cfg.total_cpus == pytest.approx(0.45)
    instance = spec.cls(*spec.args, **spec.kwargs)
    out = instance.step([message("hi there"), message("bye")], [{"prompt": "p"}] * 2)
    assert out.rewards.tolist() == [1.5, 0.5]


def test_reward_function_is_batched_in_the_builtin_environment(plugins: str) -> None:
    spec = env({"len": {"reward_fn": f"{plugins}:length_reward"}}).specs()["len"]
    assert spec.cls is RewardFnEnvironment and spec.processor is reward_fn_processor
    instance = spec.cls(*spec.args, **spec.kwargs)
    meta = [
        {"prompt": "a", "answer": None, "metadata": {}},
        {"prompt": "b", "answer": "2", "metadata": {"bias": 1}},
    ]
    out = instance.step([message("abcde"), message("abcd")], meta)
    assert out.rewards.tolist() == [0.5, 3.0]
    assert out.terminateds.tolist() == [True, True] and out.metadata == [None, None]
    bad = RewardFnEnvironment(f"{plugins}:not_a_number")
    with pytest.raises(ValueError, match="returned 'high' for sample 0; it must return a finite"):
        bad.step([message("x")], meta[:1])
    assert not spec.returns_answers and out.answers == [None, None]  # maj@k has nothing to vote


def test_reward_functions_give_named_rewards(plugins: str) -> None:
    """``reward_fns`` calls each function like ``reward_fn`` and returns the scores as
    ``reward/<name>`` rewards (sorted), declared at config time for GDPO's checks."""
    section = {
        "reward_fns": {"len": f"{plugins}:length_reward", "a": f"{plugins}:starts_with_a"},
        "answer_fn": f"{plugins}:first_word",
    }
    spec = env({"two": section}).specs()["two"]
    assert spec.cls is RewardFnEnvironment and spec.processor is reward_fn_processor
    assert spec.reward_components == ("reward/a", "reward/len") and spec.returns_answers
    instance = spec.cls(*spec.args, **spec.kwargs)
    meta = [{"prompt": "p", "answer": None, "metadata": {}}] * 2
    out = instance.step([message("abcde"), message("bcdefghijk")], meta)
    assert list(out.rewards) == ["reward/a", "reward/len"]
    assert out.rewards["reward/a"].tolist() == [1.0, 0.0]
    assert out.rewards["reward/len"].tolist() == [0.5, 1.0]
    assert out.answers == ["abcde", "bcdefghijk"] and out.terminateds.tolist() == [True, True]
    assert env({"one": {"reward_fn": f"{plugins}:length_reward"}}).specs()["one"].reward_components == ()
    assert MathEnvironment.reward_components == ()
    bad = RewardFnEnvironment(reward_fns={"n": f"{plugins}:not_a_number"})
    with pytest.raises(ValueError, match=f"'{plugins}:not_a_number' returned 'high' for sample 0"):
        bad.step([message("x")], meta[:1])


def test_answer_function_gives_the_answers_of_a_reward_function_task(plugins: str) -> None:
    """``answer_fn`` is called like the reward function; its strings (or None) are the
    environment's answers, which maj@k votes over."""
    section = {"reward_fn": f"{plugins}:length_reward", "answer_fn": f"{plugins}:first_word"}
    spec = env({"len": section}).specs()["len"]
    assert spec.kwargs == {"reward_fn": section["reward_fn"], "answer_fn": section["answer_fn"]}
    assert spec.returns_answers
    instance = spec.cls(*spec.args, **spec.kwargs)
    meta = [{"prompt": "a", "answer": None, "metadata": {}}] * 2
    out = instance.step([message("seven days"), message(" " * 5)], meta)
    assert out.answers == ["seven", None] and out.rewards.tolist() == [1.0, 0.5]
    bad = RewardFnEnvironment(section["reward_fn"], f"{plugins}:a_number")
    with pytest.raises(ValueError, match="returned 7 for sample 0; it must return a string, or "
                                         "None"):
        bad.step([message("x")], meta[:1])
    assert not env({"echo": {"cls": f"{plugins}:EchoEnv", "word": "a"}}).specs()["echo"].returns_answers


def test_processor_named_by_import_path(plugins: str) -> None:
    path = f"{plugins}:my_processor"
    spec = env({"len": {"reward_fn": f"{plugins}:length_reward", "processor": path}}).specs()
    assert spec["len"].processor.__name__ == "my_processor"


@pytest.mark.parametrize(
    "section, needles",
    [
        ({"cls": "{m}:Nope"}, ["env.mine.cls='{m}:Nope': '{m}' has no attribute 'Nope'"]),
        ({"cls": "{m}:length_reward"}, ["is not a subclass of", "EnvironmentInterface"]),
        ({"cls": "{m}:Half"}, ["leaves abstract methods unimplemented"]),
        ({"cls": "{m}:EchoEnv"}, ["cannot be started with the section's keys (none)"]),
        ({"cls": "{m}:EchoEnv", "word": "a", "colour": 1}, ["keys (colour, word)", "colour"]),
        ({"reward_fn": "{m}:wrong_arity"}, [
            "env.mine.reward_fn='{m}:wrong_arity' cannot be called as "
            "fn(prompt, response, answer, metadata) -> float"
        ]),
        ({"reward_fn": "missing_mod_q:f"}, ["cannot import module 'missing_mod_q'", "PYTHONPATH"]),
        ({"reward_fn": "{m}:length_reward", "scale": 2}, ["reward_fn takes no other keys"]),
        ({"reward_fns": {"a": "{m}:length_reward"}, "scale": 2}, ["reward_fns takes no other keys"]),
        ({"reward_fns": {}}, ["env.mine.reward_fns is empty"]),
        ({"reward_fns": {"a": "{m}:wrong_arity"}}, ["env.mine.reward_fns.a='{m}:wrong_arity'"]),
        ({"reward_fns": {"a": "{m}:length_reward"}, "answer_fn": "{m}:wrong_arity"}, [
            "env.mine.answer_fn='{m}:wrong_arity'"
        ]),
        ({"num_cpus": 0.1}, ["needs exactly one of cls", "and reward_fn"]),
        ({"cls": "{m}:EchoEnv", "reward_fn": "{m}:length_reward"}, ["exactly one of cls"]),
        ({"reward_fn": "{m}:length_reward", "answer_fn": "{m}:wrong_arity"}, [
            "env.mine.answer_fn='{m}:wrong_arity' cannot be called as "
            "fn(prompt, response, answer, metadata) -> str or None"
        ]),
        ({"cls": "{m}:EchoEnv", "word": "a", "answer_fn": "{m}:first_word"}, [
            "answer_fn goes with reward_fn", "returns_answers = True"
        ]),
        ({"reward_fn": "{m}:length_reward", "processor": "mathh"}, [
            "env.mine.processor='mathh': no data processor is registered", "'reward_fn'"
        ]),
    ],
)
def test_bad_plugin_sections_are_refused_at_config_time(
    plugins: str, section: dict[str, Any], needles: list[str]
) -> None:
    def fill(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value.format(m=plugins) if isinstance(value, str) else value

    filled = fill(section)
    text = refusal({"mine": filled})
    for needle in needles:
        assert needle.format(m=plugins) in text, text


def test_check_task_suggests_the_close_name() -> None:
    cfg = env({})
    cfg.check_task("math", "data.task_name")
    with pytest.raises(ValueError, match="did you mean 'math'\\? configured tasks are \\['math'\\]"):
        cfg.check_task("maths", "data.task_name")
