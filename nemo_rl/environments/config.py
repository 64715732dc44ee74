"""Typed config of the environments (the ``env`` section): one section per task.

The section's name is the task name that rows carry (``data.task_name`` or a row's
``task_name``). Built-in tasks have typed sections (``env.math`` follows NeMo RL's keys,
``num_workers`` and ``stop_strings``); a section left at None starts no environment. Any other
name is a plug-in section (:class:`PluginEnvConfig`): an environment class named by import path
with its own keyword arguments, or a reward function. Every section, built-in or plug-in, is
resolved the same way (:mod:`nemo_rl.environments.registry`) when the recipe is validated, and
:func:`nemo_rl.environments.utils.create_environments` starts one Ray actor per section.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Optional

from pydantic import ConfigDict, Field, model_validator

from nemo_rl.environments.registry import EnvironmentSpec, resolve_environment
from nemo_rl.utils.config import ConfigModel


class EnvActorConfig(ConfigModel):
    """What every environment section states: the actor's Ray CPUs and the rows' processor."""

    num_cpus: float = Field(
        default=0.25,
        gt=0,
        description="Logical Ray CPUs the environment's actor reserves (fractions allowed; "
        "environments are light, so several share a core).",
    )
    processor: Optional[str] = Field(
        default=None,
        description="Data processor turning this task's rows into prompts: a registered name "
        "('math', 'prompt', 'reward_fn', 'sft') or an import path 'package.module:function'. "
        "None: the environment class's default_processor.",
    )

    # Import path of the environment class a built-in section starts (called with the section).
    environment_class: ClassVar[str] = ""

    def environment_call(self) -> tuple[str, str, tuple[Any, ...], dict[str, Any]]:
        """``(class import path, recipe field naming it, args, kwargs)`` that start this
        section's environment: a built-in section is passed to its class as the one argument."""
        return self.environment_class, "", (self,), {}


class MathEnvConfig(EnvActorConfig):
    """``env.math``: single-turn answers checked with math-verify."""

    environment_class: ClassVar[str] = "nemo_rl.environments.math_environment:MathEnvironment"

    num_workers: int = Field(
        default=1,
        ge=1,
        description="Processes that verify a step's responses in parallel; 1 verifies "
        "in the actor's own process.",
    )
    stop_strings: Optional[list[str]] = Field(
        default=None, description="Stop strings for the next turn (None: none)."
    )
    verify_timeout_s: int = Field(
        default=5,
        ge=0,
        description="Seconds math-verify may spend parsing or comparing one answer before it "
        "counts as wrong; 0 disables the limit.",
    )


class NumberGuessEnvConfig(EnvActorConfig):
    """``env.number_guess``: guess the secret number, told "higher" or "lower" each turn."""

    environment_class: ClassVar[str] = (
        "nemo_rl.environments.number_guess_environment:NumberGuessEnvironment"
    )

    max_turns: int = Field(
        default=6, ge=1, description="Guesses allowed before the episode ends unsolved."
    )
    turn_penalty: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Reward lost per extra guess: solving on guess t earns "
        "max(0, 1 - turn_penalty * (t - 1)).",
    )


class CalculatorEnvConfig(EnvActorConfig):
    """``env.calculator``: the model may compute ``<calc>expr</calc>`` before answering."""

    environment_class: ClassVar[str] = (
        "nemo_rl.environments.calculator_environment:CalculatorEnvironment"
    )

    max_turns: int = Field(
        default=4,
        ge=1,
        description="Assistant turns allowed (calculator calls plus the final answer).",
    )
    timeout_s: float = Field(
        default=1.0, gt=0, description="Seconds one expression may take to evaluate."
    )
    max_expression_chars: int = Field(
        default=200, ge=1, description="Longest expression evaluated; longer ones are refused."
    )
    max_exponent: int = Field(
        default=64, ge=1, description="Largest absolute exponent allowed in ``a ** b``."
    )
    max_result_digits: int = Field(
        default=100,
        ge=1,
        description="Largest number of decimal digits of any intermediate integer result.",
    )
    verify_timeout_s: int = Field(
        default=5,
        ge=0,
        description="Seconds math-verify may spend on the final answer; 0 disables the limit.",
    )


class CodeEnvConfig(EnvActorConfig):
    """``env.code``: the model's Python runs in a sandbox; the row's tests give the reward
    (docs/code_environment.md)."""

    environment_class: ClassVar[str] = "nemo_rl.environments.code_environment:CodeEnvironment"

    num_workers: int = Field(
        default=1, ge=1, description="Sandbox runs in flight at once (one uid each)."
    )
    terminate_on_evaluation: bool = Field(
        default=False,
        description="True: the first reply's code is tested and the episode ends (single "
        "turn). False: each reply's code runs and its output comes back, until a reply "
        "without code (or turn max_turns) ends the episode and the last code is tested.",
    )
    max_turns: int = Field(default=4, ge=1, description="Assistant turns allowed.")
    timeout_s: float = Field(
        default=5.0, gt=0, description="Wall-clock seconds of one run before it is killed."
    )
    cpu_time_s: int = Field(default=5, ge=1, description="CPU seconds of one run (RLIMIT_CPU).")
    memory_mb: int = Field(
        default=512, ge=64, description="Address space of each process of a run, MiB (RLIMIT_AS)."
    )
    max_processes: int = Field(
        default=16,
        ge=1,
        description="Processes and threads of a run (RLIMIT_NPROC of its own uid; not "
        "enforced in the unisolated mode when the trainer runs as root).",
    )
    max_output_bytes: int = Field(
        default=4096,
        ge=64,
        description="Bytes kept of stdout and of stderr each (the rest is cut, with a marker); "
        "also the largest file a run may write.",
    )
    work_dir_mb: int = Field(
        default=64, ge=1, description="Size of a run's private tmpfs folder, MiB (isolated mode)."
    )
    sandbox_uid: int = Field(
        default=62000,
        ge=1,
        description="First unprivileged uid (and gid) runs use: sandbox_uid .. sandbox_uid + "
        "num_workers - 1; they must own no other processes on the machine.",
    )
    python: Optional[str] = Field(
        default=None, description="Interpreter of the programs; None: the trainer's."
    )
    allow_no_network_isolation: bool = Field(
        default=False,
        description="Where the sandbox cannot be isolated (not root, or no unshare), run the "
        "programs anyway with the limits only: no network, PID or file-system isolation, as "
        "the trainer's user (docs/code_environment.md). False: the environment refuses to start.",
    )


REWARD_FN_ENVIRONMENT = "nemo_rl.environments.reward_fn_environment:RewardFnEnvironment"
AGENT_ENVIRONMENT = "nemo_rl.environments.agent_environment:AgentEnvironment"


class PluginEnvConfig(EnvActorConfig):
    """``env.<task>`` for a task without a built-in section: exactly one of ``cls``,
    ``reward_fn``, ``reward_fns`` and ``agent_fn`` (which also takes ``timeout_s``). Every key
    beyond the declared ones is passed to ``cls`` as a keyword argument (``env.my_task: {cls:
    my_pkg.envs:MyEnv, num_cpus: 0.2, difficulty: 3}`` starts ``MyEnv(difficulty=3)``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    cls: Optional[str] = Field(
        default=None,
        description="Import path 'package.module:Class' of an EnvironmentInterface subclass; "
        "started as Class(**the section's other keys).",
    )
    reward_fn: Optional[str] = Field(
        default=None,
        description="Import path 'package.module:function' of a single-turn reward "
        "fn(prompt, response, answer, metadata) -> float, run batched in a built-in "
        "environment's actor (processor 'reward_fn').",
    )
    reward_fns: Optional[dict[str, str]] = Field(
        default=None,
        description="Instead of reward_fn, several named reward functions {name: "
        "'package.module:function'}, each called like reward_fn: the task's rewards are "
        "reward/<name> (what grpo.adv_estimator.name=gdpo normalises one by one; metrics "
        "reward/<name>), its total reward their sum.",
    )
    answer_fn: Optional[str] = Field(
        default=None,
        description="With reward_fn or reward_fns: import path 'package.module:function' of "
        "fn(prompt, response, answer, metadata) -> str or None, called like the reward "
        "function: the answer the response gives (what nemo-rl eval's maj@k votes over and "
        "samples.jsonl records). None: the task extracts no answers, so maj@k is refused.",
    )

    agent_fn: Optional[str] = Field(
        default=None,
        description="Import path 'package.module:function' of an agent fn(base_url, row) -> "
        "float that runs each episode against the engines' OpenAI-compatible endpoint (needs "
        "policy.generation.vllm_cfg.expose_http_server; nemo_rl.environments.agent_environment"
        "). Its section may also set timeout_s (seconds per episode, default 120, at most 240).",
    )

    def environment_call(self) -> tuple[str, str, tuple[Any, ...], dict[str, Any]]:
        """The class of ``cls`` with the section's extra keys, the agent environment with
        ``agent_fn`` (and its extra keys), or the reward-function environment with ``reward_fn``
        or ``reward_fns`` (and ``answer_fn`` when set)."""
        kwargs = dict(self.model_extra or {})
        if self.cls is not None:
            return self.cls, "cls", (), kwargs
        if self.agent_fn is not None:
            return AGENT_ENVIRONMENT, "agent_fn", (), {"agent_fn": self.agent_fn, **kwargs}
        key = "reward_fn" if self.reward_fn is not None else "reward_fns"
        functions: dict[str, Any] = {key: getattr(self, key)}
        if self.answer_fn is not None:
            functions["answer_fn"] = self.answer_fn
        return REWARD_FN_ENVIRONMENT, key, (), functions

    @model_validator(mode="after")
    def _one_plugin(self) -> PluginEnvConfig:
        if [self.cls, self.reward_fn, self.reward_fns, self.agent_fn].count(None) != 3:
            raise ValueError(
                "a plug-in environment section needs exactly one of cls "
                "('package.module:Class'), reward_fn, agent_fn ('package.module:function') and "
                "reward_fns ({name: 'package.module:function', ...})"
            )
        if self.answer_fn is not None and self.reward_fn is None and self.reward_fns is None:
            raise ValueError(
                "answer_fn goes with reward_fn or reward_fns; an environment class (cls) returns its answers "
                "from step() and sets returns_answers = True"
            )
        if (self.reward_fn is not None or self.reward_fns is not None) and self.model_extra:
            raise ValueError(
                f"{self.environment_call()[1]} takes no other keys (got "
                f"{sorted(self.model_extra)}); bind them in your function, or write an "
                "environment class (cls) that takes them"
            )
        return self


class EnvConfigs(ConfigModel):
    """``env``: the environments of a run, by task name; None leaves a built-in task out,
    any other name is a plug-in (:class:`PluginEnvConfig`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    __pydantic_extra__: dict[str, PluginEnvConfig] = Field(init=False)  # type: ignore[assignment]

    math: Optional[MathEnvConfig] = Field(
        default_factory=MathEnvConfig, description="Math answers (task_name 'math')."
    )
    number_guess: Optional[NumberGuessEnvConfig] = Field(
        default=None, description="Number guessing game (task_name 'number_guess')."
    )
    calculator: Optional[CalculatorEnvConfig] = Field(
        default=None, description="Calculator tool use (task_name 'calculator')."
    )
    code: Optional[CodeEnvConfig] = Field(
        default=None, description="Sandboxed Python execution and tests (task_name 'code')."
    )

    def sections(self) -> dict[str, EnvActorConfig]:
        """``{task name: section}`` of every configured environment, built-in then plug-in."""
        built_in = {name: getattr(self, name) for name in type(self).model_fields}
        configured = {name: cfg for name, cfg in built_in.items() if cfg is not None}
        return {**configured, **(self.model_extra or {})}

    def specs(self) -> dict[str, EnvironmentSpec]:
        """``{task name: resolved environment}`` of every section (see
        :func:`~nemo_rl.environments.registry.resolve_environment`)."""
        return {name: resolve_environment(name, cfg) for name, cfg in self.sections().items()}

    def agent_tasks(self) -> list[str]:
        """Names of the sections run by an agent plug-in (``agent_fn``)."""
        return [
            name for name, cfg in self.sections().items()
            if isinstance(cfg, PluginEnvConfig) and cfg.agent_fn is not None
        ]

    @property
    def total_cpus(self) -> float:
        """Logical Ray CPUs all configured environment actors reserve together."""
        return sum(section.num_cpus for section in self.sections().values())

    def check_task(self, task_name: str, field: str) -> None:
        """Raise ValueError unless ``task_name`` has a section, naming ``field``, the close
        match and the configured tasks."""
        sections = self.sections()
        if task_name in sections:
            return
        close = difflib.get_close_matches(task_name, list(sections), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"{field}={task_name!r} names no environment: {hint}configured tasks are "
            f"{sorted(sections)}; fix the name or configure env.{task_name} (a built-in "
            f"section, or a plug-in: cls or reward_fn)"
        )

    @model_validator(mode="after")
    def _resolve_plugins(self) -> EnvConfigs:
        """Every section's class, processor and required fields resolve (imports plug-ins)."""
        self.specs()
        return self
