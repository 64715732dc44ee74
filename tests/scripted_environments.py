"""Environments with known rewards for tests of reward-dependent logic (dynamic sampling).

Importable from any test module as ``scripted_environments`` (pytest.ini: ``pythonpath = tests``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from ray import cloudpickle

from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn

# Ray workers do not have tests/ on their path: ship these classes to actors by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ParityEnvironment(EnvironmentInterface):
    """Single turn: samples of prompts marked ``mixed`` (``extra_env_info``) score 0, 1, 0,
    1, ... in row order, so a group of consecutive rows has reward variance; all other
    samples score 0."""

    def step(self, message_log_batch: Any, metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        n = len(metadata)
        rewards = [float(bool(m.get("mixed")) and i % 2 == 1) for i, m in enumerate(metadata)]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""}] * n,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[None] * n,
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        return batch, {}
