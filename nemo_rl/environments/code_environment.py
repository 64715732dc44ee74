"""A code-execution environment: the model's Python runs in a sandbox, the row's tests score it.

The program of a reply is its last ``<code>...</code>`` block, else its last fenced
```` ```python ```` block. Multi-turn (``terminate_on_evaluation: false``): each reply with a
program runs it (:class:`~nemo_rl.environments.sandbox.Sandbox`) and its output comes back as
a ``tool`` message ``<result>...</result>``; a reply without a program ends the episode and the
last program that ran is tested (a reply at turn ``max_turns`` is tested at once). Single-turn
(``terminate_on_evaluation: true``): the first reply's program is tested and the episode ends.

A row carries its tests in ``tests``, a list whose items are either

- a string of Python statements (e.g. ``"assert add(2, 3) == 5"``) run after the program in
  the same process: it passes when the run ends with exit code 0 after the statements (a
  marker printed after them, unknown to the program until then, must be the last line of
  stdout, so an early ``exit(0)`` does not pass); or
- ``{"input": str, "output": str}``: the program runs with ``input`` as stdin and passes when
  its stdout equals ``output`` line by line (trailing spaces and trailing blank lines
  ignored) and it exits with 0.

Each test is its own sandbox run. The reward is the fraction of the tests passed (1.0: all);
a reply with no program to test scores 0.

Counts (:meth:`CodeEnvironment.take_metrics`, since its last call; the GRPO step logs them
as ``env/<task>/<name>`` every step): ``code_runs``, ``code_timeouts``,
``code_cpu_limits``, ``code_memory_errors``, ``code_output_truncations``,
``code_process_limits``, ``code_network_denials``, ``code_filesystem_denials``,
``code_sandbox_violations`` (the last three plus process limits), ``code_setup_failures``,
``code_tests_passed``, ``code_tests_failed``.
"""

from __future__ import annotations

import queue
import re
import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.common import (
    batch_success_metrics,
    last_assistant_content,
    tagged_text,
)
from nemo_rl.environments.config import CodeEnvConfig
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.environments.sandbox import (
    Outcome,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    isolation_problem,
)

CODE_STOP_STRINGS = ["</code>"]

Test = Union[str, dict[str, str]]

_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", flags=re.DOTALL)

# Counter name of each outcome (ok and error are counted only as runs).
_OUTCOME_COUNTS = {
    Outcome.TIMEOUT: "code_timeouts",
    Outcome.CPU_LIMIT: "code_cpu_limits",
    Outcome.MEMORY: "code_memory_errors",
    Outcome.OUTPUT_LIMIT: "code_output_truncations",
    Outcome.PROCESS_LIMIT: "code_process_limits",
    Outcome.NETWORK_DENIED: "code_network_denials",
    Outcome.FILESYSTEM_DENIED: "code_filesystem_denials",
    Outcome.SETUP_FAILED: "code_setup_failures",
}
_VIOLATIONS = (Outcome.PROCESS_LIMIT, Outcome.NETWORK_DENIED, Outcome.FILESYSTEM_DENIED)
COUNT_NAMES = (
    "code_runs",
    *sorted(set(_OUTCOME_COUNTS.values())),
    "code_sandbox_violations",
    "code_tests_passed",
    "code_tests_failed",
)


def extract_program(text: str) -> Optional[str]:
    """The program of a reply: its last ``<code>`` block, else its last fenced python block
    (an unclosed one at the end counts: engines drop the stop string), else None."""
    code = tagged_text(text, "code")
    if code is None:
        fenced = _FENCED.findall(text)
        code = fenced[-1].strip() if fenced else None
    return code or None


def check_tests(tests: Any, where: str) -> list[Test]:
    """``tests`` as a list of tests (module docstring's format).

    Raises:
        ValueError: naming ``where`` and the bad item.
    """
    if not isinstance(tests, list) or not tests:
        raise ValueError(
            f"{where}: 'tests' must be a non-empty list of assert statements (strings) or "
            f'{{"input": ..., "output": ...}} pairs, got {tests!r:.200}'
        )
    for k, test in enumerate(tests):
        if isinstance(test, str):
            continue
        if (
            isinstance(test, dict)
            and set(test) == {"input", "output"}
            and all(isinstance(v, str) for v in test.values())
        ):
            continue
        raise ValueError(
            f"{where}: tests[{k}] must be a string of Python statements or "
            f'{{"input": str, "output": str}}, got {test!r:.200}'
        )
    return tests


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@dataclass(frozen=True)
class _Job:
    """One sandbox run: ``source`` fed ``stdin``; ``marker``: the last stdout line an assert
    test must print; ``expected``: the stdout an input/output test must print."""

    source: str
    stdin: str = ""
    marker: Optional[str] = None
    expected: Optional[str] = None

    def passed(self, result: SandboxResult) -> bool:
        if not result.ok or result.output_truncated:
            return False
        if self.marker is not None:
            lines = _lines(result.stdout)
            return bool(lines) and lines[-1] == self.marker
        return _lines(result.stdout) == _lines(self.expected or "")


def _test_job(program: str, test: Test) -> _Job:
    if isinstance(test, str):
        marker = f"tests-done-{secrets.token_hex(8)}"
        return _Job(f"{program}\n\n{test}\nprint({marker!r})\n", marker=marker)
    return _Job(program, stdin=test["input"], expected=test["output"])


def format_output(result: SandboxResult) -> str:
    """The observation of a run: ``<result>`` stdout, stderr and how it ended ``</result>``."""
    parts = [result.stdout.rstrip("\n")]
    if result.stderr.strip():
        parts.append(result.stderr.rstrip("\n"))
    if result.outcome is Outcome.TIMEOUT:
        parts.append("[killed: wall-clock limit]")
    elif result.outcome is Outcome.CPU_LIMIT:
        parts.append("[killed: CPU-time limit]")
    body = "\n".join(p for p in parts if p)
    return f"<result>\n{body}\n</result>"


def _refusal(where: str, problem: str) -> str:
    return (
        f"{where}: the code sandbox cannot be isolated here: {problem}; run the trainer as "
        f"root with util-linux's unshare, or set {where}.allow_no_network_isolation=true to run "
        "programs with the limits only (no network, PID or file-system isolation: "
        "docs/code_environment.md)"
    )


class CodeEnvironment(EnvironmentInterface):
    """Runs the model's Python and scores it with the row's tests; usable in-process or as a
    Ray actor.

    Metadata per sample: ``{"tests": [...]}`` (the row's other fields are kept too); the
    environment adds ``"turn"`` and ``"program"`` (the last program that ran).

    Raises:
        nemo_rl.environments.sandbox.SandboxUnavailable: isolation is unavailable and
            ``allow_no_network_isolation`` is false, or the sandbox cannot run a program.
    """

    default_processor = "prompt"
    required_fields = ("tests",)

    def __init__(self, cfg: Optional[CodeEnvConfig] = None) -> None:
        self.cfg = cfg or CodeEnvConfig()
        problem = isolation_problem()
        if problem is not None and not self.cfg.allow_no_network_isolation:
            raise SandboxUnavailable(_refusal("env.code", problem))
        limits = SandboxLimits(
            timeout_s=self.cfg.timeout_s,
            cpu_time_s=self.cfg.cpu_time_s,
            memory_mb=self.cfg.memory_mb,
            max_processes=self.cfg.max_processes,
            max_output_bytes=self.cfg.max_output_bytes,
            work_dir_mb=self.cfg.work_dir_mb,
        )
        self.sandbox = Sandbox(
            limits,
            isolate=problem is None,
            uid=self.cfg.sandbox_uid,
            slots=self.cfg.num_workers,
            python=self.cfg.python,
        )
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in range(self.cfg.num_workers):
            self._slots.put(slot)
        self._pool = ThreadPoolExecutor(self.cfg.num_workers, thread_name_prefix="sandbox")
        self.counts: Counter[str] = Counter({name: 0 for name in COUNT_NAMES})

    @classmethod
    def check_arguments(cls, where: str, *args: Any, **kwargs: Any) -> None:
        """Isolation works on this machine, unless the section allows running without it."""
        cfg = args[0] if args else CodeEnvConfig()
        if cfg.allow_no_network_isolation:
            return
        problem = isolation_problem()
        if problem is not None:
            raise ValueError(_refusal(where, problem))

    @property
    def isolated(self) -> bool:
        """Whether programs run in the isolated mode."""
        return self.sandbox.isolate

    def _run(self, job: _Job) -> SandboxResult:
        slot = self._slots.get()
        try:
            return self.sandbox.run(job.source, job.stdin, slot=slot)
        finally:
            self._slots.put(slot)

    def _count(self, result: SandboxResult) -> None:
        self.counts["code_runs"] += 1
        if result.outcome in _OUTCOME_COUNTS:
            self.counts[_OUTCOME_COUNTS[result.outcome]] += 1
        elif result.output_truncated:
            self.counts["code_output_truncations"] += 1
        if result.outcome in _VIOLATIONS:
            self.counts["code_sandbox_violations"] += 1

    def run_jobs(self, jobs: list[_Job]) -> list[SandboxResult]:
        """Every job's result, ``num_workers`` at a time, counted."""
        results = list(self._pool.map(self._run, jobs))
        for result in results:
            self._count(result)
        return results

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Run each sample's program, or test its final one (module docstring).

        Raises:
            ValueError: a sample's ``tests`` are missing or malformed (names the sample).
        """
        states, plans = [], []
        jobs: list[_Job] = []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            state = dict(meta or {})
            tests = check_tests(state.get("tests"), f"sample {i}")
            state["turn"] = int(state.get("turn", 0)) + 1
            program = extract_program(last_assistant_content(log))
            final = (
                program is None
                or self.cfg.terminate_on_evaluation
                or state["turn"] >= self.cfg.max_turns
            )
            if program is not None:
                state["program"] = program
            start = len(jobs)
            if not final:
                jobs.append(_Job(program))
            elif state.get("program") is not None:
                jobs.extend(_test_job(state["program"], test) for test in tests)
            states.append(state)
            plans.append((final, start, len(jobs)))
        results = self.run_jobs(jobs)
        observations, new_metadata, rewards, terminateds = [], [], [], []
        for state, (final, start, end) in zip(states, plans):
            if not final:
                observations.append({"role": "tool", "content": format_output(results[start])})
                new_metadata.append(state)
                rewards.append(0.0)
                terminateds.append(False)
                continue
            passed = sum(job.passed(r) for job, r in zip(jobs[start:end], results[start:end]))
            total = len(state["tests"])
            self.counts["code_tests_passed"] += passed
            self.counts["code_tests_failed"] += total - passed
            verdict = f"passed {passed}/{total} tests" if end > start else "no code to test"
            observations.append({"role": "environment", "content": verdict})
            new_metadata.append(None)
            rewards.append(passed / total)
            terminateds.append(True)
        size = len(observations)
        return EnvironmentReturn(
            observations=observations,
            metadata=new_metadata,
            next_stop_strings=[list(CODE_STOP_STRINGS)] * size,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminateds, dtype=torch.bool),
            answers=[None] * size,
        )

    def take_metrics(self) -> dict[str, float]:
        """The counts since the last call (``COUNT_NAMES``), then zeroed."""
        counts = {name: float(self.counts[name]) for name in COUNT_NAMES}
        self.counts = Counter({name: 0 for name in COUNT_NAMES})
        return counts

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """``accuracy`` (all tests passed) and ``pass@k``; batch unchanged."""
        return batch, batch_success_metrics(batch)
