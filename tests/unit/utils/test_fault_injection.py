"""Test-only fault injection: which arrival at a point fires an armed fault, the training step
shared through the faults folder, and "once" across processes (a restarted actor does not
fire its killer again)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_rl.utils import fault_injection
from nemo_rl.utils.fault_injection import FAULTS_DIR_ENV, FAULTS_ENV, enter_step, fault_at


@pytest.fixture
def arm(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``arm(faults, folder=None)`` sets the environment a run's processes would get."""

    def armed(faults: list[dict], folder: Path | None = None) -> None:
        monkeypatch.setenv(FAULTS_ENV, json.dumps(faults))
        if folder is not None:
            monkeypatch.setenv(FAULTS_DIR_ENV, str(folder))
        fault_injection._armed.cache_clear()
        fault_injection._hits.clear()

    yield armed
    fault_injection._armed.cache_clear()
    fault_injection._hits.clear()


def test_unarmed_points_fire_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    fault_injection._armed.cache_clear()
    fault_injection._hits.clear()  # arrivals an earlier test's armed points counted here
    assert fault_at("generation.generate", replica=0) is None
    enter_step(3)  # nothing armed: no file, no error
    assert fault_injection._hits == {}


def test_a_fault_fires_at_its_arrival_and_context_once(arm) -> None:
    arm([
        {"point": "generation.generate", "replica": 1, "hit": 2, "action": "kill"},
        {"point": "generation.refit", "verb": "init_collective", "action": "kill"},
    ])
    # replica 1's first arrival, then its second (the armed one), then a third
    assert [fault_at("generation.generate", replica=1) for _ in range(3)] == [None, "kill", None]
    assert fault_at("generation.refit", replica=0, verb="update_weights_from_collective") is None
    assert fault_at("generation.refit", replica=0, verb="init_collective") == "kill"
    assert fault_at("generation.refit", replica=0, verb="init_collective") is None


def test_the_faults_folder_shares_the_step_and_fires_each_fault_once_across_processes(
    arm, tmp_path: Path
) -> None:
    arm(
        [
            {"point": "environment.step", "step": 2, "action": "kill"},
            {"point": "environment.step", "step": 3, "action": "kill"},
        ],
        tmp_path,
    )
    assert fault_at("environment.step", env="MathEnvironment") is None  # step 0: before step 1
    enter_step(2)
    assert (tmp_path / "step").read_text() == "2"
    assert fault_at("environment.step", env="MathEnvironment") == "kill"

    # another process of the run (an actor restarted after the kill): the step-2 fault fired
    # already, the step-3 one has not
    probe = (
        "from nemo_rl.utils.fault_injection import fault_at, enter_step\n"
        "first = fault_at('environment.step')\n"
        "enter_step(3)\n"
        "print(first, fault_at('environment.step'), fault_at('environment.step'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["None", "kill", "None"]
    assert fault_at("environment.step", env="MathEnvironment") is None  # fired over there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fired-0", "fired-1", "step"]
