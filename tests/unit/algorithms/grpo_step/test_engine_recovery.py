"""redo_on_engine_death: what the step does around an engine's death (the real engines'
restart is tested in tests/unit/models/generation/test_vllm_generation.py and end to end in
tests/functional/test_engine_and_env_faults.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from nemo_rl.algorithms.grpo_step.engine_recovery import redo_on_engine_death
from nemo_rl.models.generation.vllm.engine_health import EngineFault


class _Engines:
    """A generation facade whose engines die as scripted: ``deaths`` lists, per call of
    ``restart_dead_engines``, the replicas found dead (an exception: the restart fails)."""

    def __init__(self, deaths: list[Any]) -> None:
        self.deaths = deaths
        self.sampling_step = 5
        self.calls: list[str] = []

    def restart_dead_engines(self) -> list[int]:
        self.calls.append("restart")
        found = self.deaths.pop(0)
        if isinstance(found, BaseException):
            raise found
        return found

    def finish_generation(self) -> bool:
        self.calls.append("sleep")
        return True


def _run(engines: _Engines, colocated: bool = True) -> Any:
    cfg = SimpleNamespace(
        policy=SimpleNamespace(generation=SimpleNamespace(colocated=SimpleNamespace(enabled=colocated)))
    )
    policy = SimpleNamespace(prepare_for_training=lambda: engines.calls.append("policy back"))
    return SimpleNamespace(
        cfg=cfg, policy=policy, generation=engines, generation_stale=False
    )


def test_a_batch_an_engine_died_under_is_redone_from_its_sampling_step() -> None:
    engines = _Engines(deaths=[[1]])
    run = _run(engines)
    seen: list[tuple[int, bool]] = []

    def attempt() -> str:
        seen.append((engines.sampling_step, run.generation_stale))
        engines.sampling_step += 2  # a two-turn rollout
        if len(seen) == 1:
            raise RuntimeError("ActorDiedError: engine 1")
        return "batch"

    assert redo_on_engine_death(run, attempt) == "batch"  # type: ignore[arg-type]
    # the redo starts where the broken try started, with the engines to be refit first
    assert seen == [(5, False), (5, True)] and engines.sampling_step == 7
    assert engines.calls == ["restart", "sleep", "policy back"]


def test_an_error_with_every_engine_alive_is_raised_as_it_is() -> None:
    engines = _Engines(deaths=[[]])
    with pytest.raises(ValueError, match="bad prompt"):
        redo_on_engine_death(_run(engines), lambda: (_ for _ in ()).throw(ValueError("bad prompt")))
    assert engines.calls == ["restart"]  # checked, none restarted


@pytest.mark.parametrize("where", ["restart", "refit"])
def test_an_engine_dead_for_good_stops_the_batch_with_its_fault(where: str) -> None:
    """Past the bound (found by the restart, or by a refit's own restart) the EngineFault is
    raised as it is: the training loop's stop guard adds the newest checkpoint to its line."""
    died = EngineFault("vLLM engine 0 on node1 (10.0.0.1) died (...); it was restarted 3 time(s) "
                       "already (policy.generation.max_engine_restarts=3)")
    engines = _Engines(deaths=[died])

    def attempt() -> None:
        raise died if where == "refit" else RuntimeError("ActorDiedError")

    with pytest.raises(EngineFault) as stopped:
        redo_on_engine_death(_run(engines), attempt)  # type: ignore[arg-type]
    assert stopped.value is died and died.exit_code == 75
    # a refit's fault is not taken for a death to restart: no second health check
    assert engines.calls == ([] if where == "refit" else ["restart"])
