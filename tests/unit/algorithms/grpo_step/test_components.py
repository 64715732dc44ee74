"""prepare_generation: one wake-up of the engines per rollout phase, refit or not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from nemo_rl.algorithms.grpo_step import components as components_module


class _Engines:
    """Counts the driver's wake-up calls; a colocated refit wakes the engines itself."""

    def __init__(self) -> None:
        self.wake_ups = 0

    def prepare_for_generation(self) -> bool:
        self.wake_ups += 1
        return True


@pytest.mark.parametrize("colocated", [True, False])
@pytest.mark.parametrize("stale", [True, False])
def test_prepare_generation_wakes_the_engines_once(
    monkeypatch: pytest.MonkeyPatch, colocated: bool, stale: bool
) -> None:
    refits: list[bool] = []

    def fake_refit(policy: Any, generation: _Engines, colocated: bool) -> None:
        refits.append(colocated)
        if colocated:  # as refit_policy_generation: wake, then stream into the engines
            generation.prepare_for_generation()

    monkeypatch.setattr(components_module, "refit_policy_generation", fake_refit)
    engines = _Engines()
    cfg = SimpleNamespace(
        policy=SimpleNamespace(generation=SimpleNamespace(colocated=SimpleNamespace(enabled=colocated)))
    )
    run = SimpleNamespace(cfg=cfg, policy=object(), generation=engines, generation_stale=stale)
    components_module.prepare_generation(run)  # type: ignore[arg-type]
    assert refits == ([colocated] if stale else [])
    assert engines.wake_ups == 1
    assert run.generation_stale is False
