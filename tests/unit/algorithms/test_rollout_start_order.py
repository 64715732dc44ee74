"""In which order a distillation run starts its student, teacher and vLLM engines
(:func:`nemo_rl.algorithms.distillation.setup` through
:func:`nemo_rl.algorithms.rollout_run.start_train_and_generation`), with recording stand-ins for the
worker groups: engines colocated on GPUs start only after both models are loaded; otherwise all
three start at once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.algorithms import distillation
from nemo_rl.algorithms.distillation_config import DistillationMasterConfig
from nemo_rl.utils.config import load_typed_config

REPO = Path(__file__).resolve().parents[3]


class Recorder:
    """Start/end events of the stand-ins' constructors; ``together`` of them wait for each
    other (a barrier), so a sequential start fails instead of passing."""

    def __init__(self, together: int) -> None:
        self.events: list[str] = []
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(together, timeout=20)

    def record(self, event: str) -> None:
        with self.lock:
            self.events.append(event)


def install_fakes(monkeypatch: pytest.MonkeyPatch, cfg: DistillationMasterConfig, together: int, engines_wait: bool) -> Recorder:
    """Replace Ray, the clusters, the policies, the engines, environments and logger."""
    import nemo_rl.distributed.ray_bootstrap as ray_bootstrap
    import nemo_rl.distributed.virtual_cluster as virtual_cluster
    import nemo_rl.environments.utils as env_utils
    import nemo_rl.models.generation.vllm.async_generation as async_generation
    import nemo_rl.models.policy.lm_policy as lm_policy
    import nemo_rl.utils.logger as logger

    rec = Recorder(together)

    class Workers:
        def __init__(self, name: str, wait: bool) -> None:
            rec.record(f"start {name}")
            if wait:
                rec.barrier.wait()
            rec.record(f"end {name}")

        def shutdown(self) -> None:
            pass

    class FakePolicy(Workers):
        def __init__(self, cluster: Any, policy_cfg: Any, **_: Any) -> None:
            super().__init__("teacher" if policy_cfg is cfg.teacher else "student", True)

    class FakeEngines(Workers):
        def __init__(self, *_: Any, **__: Any) -> None:
            super().__init__("engines", engines_wait)

    class FakeLogger:
        def __init__(self, _cfg: Any) -> None:
            pass

        def log_hyperparams(self, _params: Any) -> None:
            pass

    monkeypatch.setattr(ray_bootstrap, "init_ray", lambda **_: None)
    monkeypatch.setattr(virtual_cluster, "RayVirtualCluster", lambda *a, **k: object())
    monkeypatch.setattr(lm_policy, "Policy", FakePolicy)
    monkeypatch.setattr(async_generation, "vllm_generation", FakeEngines)  # the facade GRPO builds
    monkeypatch.setattr(env_utils, "create_environments", lambda _cfg: {})
    monkeypatch.setattr(logger, "Logger", FakeLogger)
    return rec


def recipe(gpus: int) -> DistillationMasterConfig:
    return load_typed_config(
        REPO / "configs" / "distillation_tiny_cpu.yaml",
        [f"cluster.gpus_per_node={gpus}", "teacher.model_name=tiny-llama", "checkpointing.enabled=false"],
        DistillationMasterConfig,
    )


def test_colocated_engines_on_gpus_start_after_student_and_teacher(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = recipe(gpus=1)
    rec = install_fakes(monkeypatch, cfg, together=2, engines_wait=False)
    components = distillation.setup(cfg)
    assert rec.events[-2:] == ["start engines", "end engines"], rec.events
    assert sorted(rec.events[:4]) == ["end student", "end teacher", "start student", "start teacher"]
    assert components.teacher is not components.policy


def test_without_gpus_student_teacher_and_engines_start_together(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = recipe(gpus=0)
    rec = install_fakes(monkeypatch, cfg, together=3, engines_wait=True)
    distillation.setup(cfg)  # the barrier of three breaks (and raises) unless all start at once
    assert sorted(rec.events[:3]) == ["start engines", "start student", "start teacher"]
