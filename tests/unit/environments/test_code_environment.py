"""Code-execution environment: scoring with a row's tests, multi-turn runs, and the sandbox
holding against attacks (each one contained, the trainer unaffected, the count reported).

The attacks need the isolated mode (root and util-linux's unshare, as in CI); elsewhere they
are skipped and only the unisolated mode and the refusal to start without it are tested.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch

from nemo_rl.environments import code_environment, sandbox
from nemo_rl.environments.code_environment import (
    CodeEnvironment,
    check_tests,
    extract_program,
)
from nemo_rl.environments.config import CodeEnvConfig, EnvConfigs
from nemo_rl.environments.sandbox import (
    TRUNCATION_MARKER,
    Outcome,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    isolation_problem,
    processes_of,
)

NO_ISOLATION = isolation_problem()
isolated_only = pytest.mark.skipif(
    NO_ISOLATION is not None, reason=f"isolated sandbox unavailable: {NO_ISOLATION}"
)

REPO = Path(__file__).resolve().parents[3]
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]


def _log(*replies: str) -> list[dict[str, str]]:
    log = [{"role": "user", "content": "write add(a, b)"}]
    for reply in replies:
        log.append({"role": "assistant", "content": reply})
    return log


def _code(source: str) -> str:
    return f"Here it is:\n<code>\n{source}\n</code>"


@pytest.fixture(scope="module")
def env() -> CodeEnvironment:
    """Multi-turn environment, short limits (1 CPU second, 2 s wall, 256 MiB, 8 processes)."""
    if NO_ISOLATION is not None:
        pytest.skip(f"isolated sandbox unavailable: {NO_ISOLATION}")
    cfg = CodeEnvConfig(
        timeout_s=2.0, cpu_time_s=1, memory_mb=256, max_processes=8, max_output_bytes=1024,
        num_workers=2,
    )
    environment = CodeEnvironment(cfg)
    assert environment.isolated
    return environment


def _run_attack(env: CodeEnvironment, source: str) -> tuple[str, dict[str, float]]:
    """One multi-turn step running ``source``: (the observation, the counts of that step)."""
    env.take_metrics()
    result = env.step([_log(_code(source))], [{"tests": ADD_TESTS}])
    assert not bool(result.terminateds[0]) and float(result.rewards[0]) == 0.0
    assert result.observations[0]["role"] == "tool"
    return result.observations[0]["content"], env.take_metrics()


def _trainer_can_still_fork() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitpid(pid, 0)[1] >> 8 == 7


# ---- scoring ----


def test_extract_program_prefers_code_tags_then_fenced_blocks():
    assert extract_program("<code>print(1)</code> and <code>print(2)</code>") == "print(2)"
    assert extract_program("x\n```python\nprint(3)\n```\n") == "print(3)"
    assert extract_program("<code>\nprint(4)") == "print(4)"  # stop string dropped
    assert extract_program("no program here") is None


def test_malformed_tests_name_the_sample_and_item():
    with pytest.raises(ValueError, match=r"sample 3: tests\[1\] must be"):
        check_tests(["assert True", {"input": "1"}], "sample 3")
    with pytest.raises(ValueError, match="sample 0: 'tests' must be a non-empty list"):
        check_tests("assert True", "sample 0")


@isolated_only
def test_correct_program_scores_one_wrong_zero_partial_between(env):
    correct = _code("def add(a, b):\n    return a + b")
    wrong = _code("def add(a, b):\n    return a - b")
    partial = _code("def add(a, b):\n    return 5")
    exits_early = _code("import sys\ndef add(a, b):\n    return 0\nsys.exit(0)")
    single_turn = CodeEnvironment(env.cfg.model_copy(update={"terminate_on_evaluation": True}))
    single_turn.take_metrics()
    result = single_turn.step(
        [_log(correct), _log(wrong), _log(partial), _log(exits_early), _log("no code")],
        [{"tests": ADD_TESTS}] * 5,
    )
    assert result.rewards.tolist() == [1.0, 0.0, 0.5, 0.0, 0.0]
    assert result.terminateds.all()
    assert [o["content"] for o in result.observations] == [
        "passed 2/2 tests", "passed 0/2 tests", "passed 1/2 tests", "passed 0/2 tests",
        "no code to test",
    ]
    counts = single_turn.take_metrics()
    assert counts["code_runs"] == 8 and counts["code_tests_passed"] == 3
    assert counts["code_tests_failed"] == 7


@isolated_only
def test_input_output_tests(env):
    tests = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4", "output": "6"}]
    right = _code("a, b = map(int, input().split())\nprint(a + b)")
    wrong = _code("a, b = map(int, input().split())\nprint(a * b)")
    last_turn = [{"tests": tests, "turn": env.cfg.max_turns - 1}] * 2
    result = env.step([_log(right), _log(wrong)], last_turn)
    assert result.rewards.tolist() == [1.0, 0.0]


@isolated_only
def test_multi_turn_output_comes_back_then_the_last_program_is_tested(env):
    first = env.step([_log(_code("def add(a, b):\n    return a + b\nprint('ran', add(1, 2))"))],
                     [{"tests": ADD_TESTS}])
    assert first.observations[0] == {"role": "tool", "content": "<result>\nran 3\n</result>"}
    assert not first.terminateds[0] and first.next_stop_strings[0] == ["</code>"]
    state = first.metadata[0]
    assert state["turn"] == 1 and "return a + b" in state["program"]
    log = _log(_code("..."), "It works, done.")
    final = env.step([log], [state])
    assert final.terminateds[0] and float(final.rewards[0]) == 1.0
    assert final.metadata == [None]


@isolated_only
def test_output_is_capped_with_a_marker_and_counted(env):
    observation, counts = _run_attack(env, "print('x' * 100000)")
    assert ("x" * 1024 + TRUNCATION_MARKER.format(limit=1024)) in observation
    assert counts["code_output_truncations"] == 1


# ---- attacks: each contained, the trainer unaffected, the count reported ----


@isolated_only
def test_infinite_loop_is_stopped_by_the_cpu_limit(env):
    # A wall-clock limit far above the CPU limit, so a busy machine cannot make it fire first.
    patient = CodeEnvironment(env.cfg.model_copy(update={"timeout_s": 30.0}))
    observation, counts = _run_attack(patient, "while True:\n    pass")
    assert "[killed: CPU-time limit]" in observation
    assert counts["code_cpu_limits"] == 1


@isolated_only
def test_sleeping_forever_is_killed_at_the_wall_clock_limit(env):
    source = "import time\nprint('started')\nwhile True:\n    time.sleep(1)"
    observation, counts = _run_attack(env, source)
    assert observation == "<result>\nstarted\n[killed: wall-clock limit]\n</result>"
    assert counts["code_timeouts"] == 1


@isolated_only
def test_fork_bomb_hits_the_process_limit_and_leaves_nothing_behind(env):
    bomb = "import os\nwhile True:\n    os.fork()"
    observation, counts = _run_attack(env, bomb)
    assert "BlockingIOError: [Errno 11]" in observation
    assert counts["code_process_limits"] == 1 and counts["code_sandbox_violations"] == 1
    for slot in range(env.cfg.num_workers):
        assert processes_of(env.cfg.sandbox_uid + slot) == []
    _trainer_can_still_fork()


@isolated_only
def test_a_child_that_detaches_dies_with_the_run(env):
    source = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
        "print('parent done')"
    )
    observation, _ = _run_attack(env, source)
    assert "parent done" in observation
    for slot in range(env.cfg.num_workers):
        assert processes_of(env.cfg.sandbox_uid + slot) == []


@isolated_only
def test_a_10_gb_allocation_fails_inside_the_sandbox(env):
    observation, counts = _run_attack(env, "block = bytearray(10 * 2**30)\nprint('allocated')")
    assert "MemoryError" in observation and "allocated" not in observation
    assert counts["code_memory_errors"] == 1


@isolated_only
def test_writes_outside_the_folder_are_refused(env, tmp_path):
    # Permissions that would let any user write the test's file: the sandbox must stop it.
    target = tmp_path / "precious.txt"
    target.write_text("original")
    target.chmod(0o666)
    tmp_path.chmod(0o777)
    for folder in tmp_path.parents:
        folder.chmod(folder.stat().st_mode | 0o001)
    new_file = tmp_path / "planted.txt"
    observation, counts = _run_attack(env, f"open({str(target)!r}, 'w').write('changed')")
    assert "No such file or directory" in observation  # the trainer's /tmp is hidden
    _run_attack(env, f"open({str(new_file)!r}, 'w').write('x')")
    assert target.read_text() == "original" and not new_file.exists()
    # what it sees of /tmp is an empty read-only tmpfs; everything else is mounted read-only
    observation, counts = _run_attack(env, "open('/tmp/nemo_rl_sandbox_planted', 'w').write('x')")
    assert "Read-only file system" in observation
    assert counts["code_filesystem_denials"] == 1 and counts["code_sandbox_violations"] == 1
    assert not Path("/tmp/nemo_rl_sandbox_planted").exists()
    # read-only (1) and nosuid (2) everywhere, and no setuid program can give privileges back
    readonly = (
        "import os, sys\nprint([os.statvfs(p).f_flag & 3 for p in ('/', '/tmp', sys.prefix)])\n"
        "print([l for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0])"
    )
    observation = _run_attack(env, readonly)[0]
    assert observation == "<result>\n[3, 3, 3]\nNoNewPrivs:\t1\n</result>"
    observation, counts = _run_attack(env, "import sys\nopen(sys.prefix + '/planted', 'w')")
    assert "Read-only file system" in observation or "Permission denied" in observation
    assert counts["code_filesystem_denials"] == 1
    own_file = "open('own.txt', 'w').write('ok')\nprint(open('own.txt').read())"
    observation, _ = _run_attack(env, own_file)
    assert observation == "<result>\nok\n</result>"


@isolated_only
def test_no_connection_even_to_localhost(env):
    with socket.create_server(("127.0.0.1", 0), backlog=8) as server:
        port = server.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        observation, counts = _run_attack(env, source)
        assert "Network is unreachable" in observation
        assert counts["code_network_denials"] == 1
        # A connection that reached the server would wait in its backlog.
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()


@isolated_only
def test_trainer_environment_variables_are_not_visible(env, monkeypatch):
    secret = "nemo-rl-test-secret-5d41402abc"
    monkeypatch.setenv("NEMO_RL_TEST_SECRET", secret)
    source = (
        "import os\nprint(dict(os.environ))\n"
        f"for pid in ['1', '{os.getpid()}', '{os.getppid()}']:\n"
        "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError as err:\n        print(type(err).__name__)\n"
    )
    observation, _ = _run_attack(env, source)
    assert secret not in observation and "NEMO_RL_TEST_SECRET" not in observation
    assert "'PATH': '/usr/local/bin:/usr/bin:/bin'" in observation


# ---- modes ----


def test_unisolated_mode_keeps_the_limits_folder_and_clean_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NEMO_RL_TEST_SECRET", "hidden")
    box = Sandbox(SandboxLimits(timeout_s=5, max_output_bytes=256), isolate=False)
    result = box.run("import os\nprint(sorted(os.environ), os.getcwd())\nprint('y' * 1000)")
    assert result.outcome is Outcome.OUTPUT_LIMIT and result.output_truncated
    assert result.stdout.endswith("y" * 10 + TRUNCATION_MARKER.format(limit=256))
    assert "NEMO_RL_TEST_SECRET" not in result.stdout and "'PATH'" in result.stdout
    work_dir = result.stdout.split("] ", 1)[1].split("\n", 1)[0]
    assert work_dir.endswith("/work") and not Path(work_dir).exists()  # removed after
    assert box.run("x = bytearray(10 * 2**30)").outcome is Outcome.MEMORY


def test_refuses_to_start_without_isolation_unless_allowed(monkeypatch):
    reason = "the trainer runs as uid 1000, not root"
    monkeypatch.setattr(code_environment, "isolation_problem", lambda: reason)
    monkeypatch.setattr(sandbox, "isolation_problem", lambda: reason)
    with pytest.raises(SandboxUnavailable, match="allow_no_network_isolation=true"):
        CodeEnvironment(CodeEnvConfig())
    with pytest.raises(ValueError, match="env.code: the code sandbox cannot be isolated here"):
        EnvConfigs.model_validate({"math": None, "code": {}})
    allowed = CodeEnvironment(CodeEnvConfig(allow_no_network_isolation=True))
    assert not allowed.isolated
    result = allowed.step([_log(_code("def add(a, b):\n    return a + b"))],
                          [{"tests": ADD_TESTS, "turn": 3}])
    assert result.rewards.tolist() == [1.0]


def test_metrics_report_accuracy_and_counts_since_last_call(monkeypatch):
    monkeypatch.setattr(code_environment, "isolation_problem", lambda: "not here")
    environment = CodeEnvironment(CodeEnvConfig(allow_no_network_isolation=True))
    environment.step([_log(_code("print(1)"))], [{"tests": ADD_TESTS}])
    batch = {"total_reward": torch.tensor([1.0, 0.0]), "idx": [0, 0]}
    assert environment.global_post_process_and_metrics(batch)[1] == {
        "accuracy": 0.5, "pass@2": 1.0,
    }
    counts = environment.take_metrics()
    assert sorted(counts) == sorted(code_environment.COUNT_NAMES)
    assert counts["code_runs"] == 1.0 and counts["code_timeouts"] == 0.0
    assert environment.take_metrics()["code_runs"] == 0.0


# ---- the recipe's data ----


@isolated_only
def test_recipe_rows_score_one_with_the_asked_program_and_demonstrations_show_its_output(env):
    rows = [
        json.loads(line)
        for name in ("code_train.jsonl", "code_val.jsonl")
        for line in (REPO / "configs" / "data" / name).read_text().splitlines()[:2]
    ]
    asked = [re.search(r"prints (\d+ [+*] \d+)\.", row["prompt"]).group(1) for row in rows]
    last_turn = [{"tests": row["tests"], "turn": env.cfg.max_turns - 1} for row in rows]
    right = env.step([_log(_code(f"print({e})")) for e in asked], last_turn)
    assert right.rewards.tolist() == [1.0] * len(rows)
    wrong = env.step([_log(_code(f"print({e} + 1)")) for e in asked], last_turn)
    assert wrong.rewards.tolist() == [0.0] * len(rows)
    demos = (REPO / "configs" / "data" / "code_sft.jsonl").read_text().splitlines()[:2]
    for demo in map(json.loads, demos):
        program = extract_program(demo["response"])
        shown = demo["response"].split("</code>", 1)[1].split("</result>", 1)[0] + "</result>"
        ran = env.step([_log(_code(program))], [{"tests": ADD_TESTS}])
        assert ran.observations[0]["content"] == shown
